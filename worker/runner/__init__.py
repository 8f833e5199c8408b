"""The device side of one engine (architecture §4): the model runner, the `ModelInput` record
every rank applies, the compiled decode step, the torch sampler, and the TP executor that runs
ranks 1..tp-1."""
