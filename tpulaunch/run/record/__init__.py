"""The run's record: its timeline of typed events (`events`, `timeline`), and what is read from it
afterwards: where the time went (`goodput`) and a trace for Perfetto (`trace`)."""
