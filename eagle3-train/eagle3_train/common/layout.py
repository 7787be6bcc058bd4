"""The names of the files one stage writes and others read, in one place and torch-free, so that a
reader imports none of its writer's stage: 01b's output directory, which 01a writes in the same
format and 01c, the pilot and 00 read."""

RAW = "raw_responses.jsonl"  # one answer a line, with the server's token ids (DESIGN.md: intermediate files)
ERRORS = "errors.jsonl"  # one failed attempt's last error a line
PROGRESS_LOG = "progress.log"
TOKENIZED = "tokenized"  # --tokenize: 01c's output inside the directory
HIDDEN = "hidden"  # --capture-hidden-states: the store, in 02's format
REQUESTS = ".vllm-requests"  # --capture-hidden-states: the connector's per-request files
# what --overwrite moves aside from such a directory (01b's and 01a's)
RAW_DIR_OUTPUTS = (RAW, ERRORS, PROGRESS_LOG, TOKENIZED, HIDDEN, REQUESTS)
