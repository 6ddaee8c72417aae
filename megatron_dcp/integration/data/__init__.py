"""Variable-length training data for the DCP entry point: length distributions and lengths files
(``lengths``), the item every dataset yields (``samples``), mock data (``mock``), indexed documents
(``indexed``), and the builder of the train/valid/test datasets from the flags (``datasets``)."""
