"""04's trainer pieces: the teachers and the TTT loss, batches from the feature shards, DDP helpers,
checkpoints, the precision choice and the training curves.
Imports the stage contract, common.target and common.draft."""
