"""One typed config per stage (config.StageConfig subclasses): the single source of each flag's
default and help, validated once, saved in the manifest, marking what may change on a resume.
Kept apart from the stage modules so a script can parse and validate without importing torch."""
