"""The link-rate sweep's report (``megatron-dcp link-sweep DIR``): its runs read back (``runs``),
the communication targets checked (``targets``), the markdown table (``sweep_table``) and the
picture (``figure``). The sweep itself is ``scripts/bench_links.sh``."""
