"""draftsmith: the Python package behind the Snakemake rules, one module per stage."""
