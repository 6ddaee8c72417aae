"""Variable-length training data for the DCP entry point: length distributions and lengths files
(``lengths``) and megatron datasets of one sequence per sample (``datasets``)."""
