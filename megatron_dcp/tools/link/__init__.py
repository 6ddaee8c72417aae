"""Link bandwidth as a controlled variable of ``bench-train`` (``--link-rate``, ``--nodes 2``):
the run inside fresh network namespaces whose links are shaped by tc's tbf qdisc.

``rate`` (tc's rate units → bytes/s), ``preflight`` (root, the tools, tbf: refused in one line
before anything is set up), ``probe`` (a throughput probe between two processes),
``namespace_run`` (what runs inside a namespace: shape, probe, then training), ``launch`` (the
parent's side: the namespaces, the veth between two nodes, the probed figures)."""
