"""04's trainer pieces: the teachers and the TTT loss, batches from the feature shards, DDP helpers,
checkpoints, the precision choice, the training curves, the warm start from an imported draft (with
L2-SP) and the checkpoint selection by replay tau.
Imports the stage contract, common.target and common.draft."""
