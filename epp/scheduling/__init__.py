"""Where a request runs: filters, weighted scorers and a picker over one endpoint snapshot."""
