"""CPU backend of megatron-core: device, stream and RNG stand-ins, megatron.training on CPU, and
the reference THD/CP core attention (the numerical oracle of the Transformer Engine path). The
patch table (``integration/patches``) installs them; docs/cpu_backend.md explains each."""
