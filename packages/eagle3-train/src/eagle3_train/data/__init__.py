"""Data in: the hidden-state dataset as the trainer sees it and its epoch plans (dataset), the
sample order, shard reading (loader), streamed datasets, batches on the device, and a run's
checked inputs (inputs). Reads artifacts through eagle3_schemas."""
