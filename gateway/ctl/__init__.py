"""The SRE command line (``gateway ctl ...``): a client of the admin API."""
