"""status: one view of a work directory, every stage's state in one line each, and the next command.

  probe.py  read a directory (json/os only, nothing written, no lock taken): which stage its files
            are, its manifest, its lock's holder and whether it is alive, progress.log, partial output
  state.py  stage_state(): a stage's facts -> done / running / interrupted / failed / not started and
            its line (pure); next_command(): the first stage not done, as its own command line
  cli.py    the command line (eagle3-train/status.py, eagle3-status)

Kept to the standard library on purpose: it runs on a box where a stage holds every core and the
GPUs, and must answer in well under a second (no torch, no transformers).
"""
