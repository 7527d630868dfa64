"""One module per fixture concern; each declares FILES and run(fixture, rec)."""
