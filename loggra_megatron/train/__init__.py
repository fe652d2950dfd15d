"""Training: the settings of the loop (:mod:`.config`), build functions (:mod:`.build`),
optimizer steps and skip counting (:mod:`.steps`), the supervised warm-up (:mod:`.warmup`),
step reporting (:mod:`.reporting`) and the RL loop (:mod:`.trainer`)."""
