"""What every stage shares. No module here imports a stage (dry_run.py names 00's planner, loaded only for
--dry-run).

  config.py         StageConfig: one typed config per stage (flags, help, validate, identity); stage ids
  errors.py         PipelineError and run_main: one `error:` line and exit 2 for user mistakes
  store.py          atomic writes, append-only JSONL (torn tail repaired), DirLock, pending ids
  manifest.py       manifests written last, read and checked by the next stage; fingerprints
  rerun.py          "is this the same run?": run.json, what may change on resume, --overwrite
  progress.py       tqdm bar + progress.log line for `tail -f`
  split.py          the held-out rule (03 coverage, 04 validation, 05 offline)
  target.py         the target's config and shape (MLA or not)
  target_layout.py  where a checkpoint keeps its language model (Kimi-K2.5 wrapper), serve flags
  tokenization.py   THE tokenization: sample -> input_ids + loss_mask (every stage)
  mismatch.py       returned ids vs the re-wrapped text: where they differ and of which kind
  screen.py         01b's answers screened for garbled output (the pilot)
  prompts.py        prompt sets (JSONL/JSON/saved/hub) -> id + messages
  client.py         the openai-SDK client: timeouts, retries with backoff, preflight
  vllm_server.py    start/stop a real vLLM server, /metrics, which model runner it took
  server_wait.py    waiting for a server given by URL that is still loading (01b, 02, 05 --wait-for-server)
  server_metrics.py a server's /metrics: its KV cache in tokens, the 01b concurrency that stays resident
  hidden_store.py   02's store format: shards, index, plan; reading (04, 05)
  hidden_checks.py  a shard against its index and the input (02 --validate, 04, 05)
  acceptance.py     vLLM's walk: acceptance length and per-position rates (04, 05)
  layout.py         the file names of 01b's output directory (01a writes it, 01c, the pilot and 00 read it)
  text_answers.py   an answer without token ids given ids re-wrapped from its text (01a, 01b's text fallback)
  dry_run.py        02's and 04's --dry-run: the planner reached by name, so no stage imports 00
"""
