"""Training: the settings of the loop (``.config``), build functions (``.build``),
optimizer steps and skip counting (``.steps``), the supervised warm-up (``.warmup``),
step reporting (``.reporting``) and the RL loop (``.trainer``)."""
