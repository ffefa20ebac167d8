"""05b's serving side: real inference servers, launched or attached, measured through one interface.

  engine.py      the Engine interface the sweep talks to (and ServedDraft): each engine's flags, launch, checks,
                 requests and measurement-only launch arguments
  registry.py    ENGINES by --engine name (05b's parser gives each its flag group); an Engine from 05b's flags;
                 which declared drafts it can serve
  sglang.py      SGLang: command and guarded flags, info document checks, preflight, /generate, SGLangEngine
  vllm.py        vLLM: command and environment, info document, counters, completions, VllmEngine
  http.py        engine-neutral requests: the answer parser, retries, server-sent events, JSON
  process.py     engine-neutral server life: launch in a process group, readiness, shutdown
  drafts.py      which draft a server serves (by folder or content), 04's export's fit, the acceptance floor
  settings.py    the --spec-settings grammar ('steps,topk,num_draft_tokens[,adaptive]')
  sweep.py       the sweep: its plan (SweepPlan, from 05b's flags), every server timed alike, counts checked
                 before they are believed, metrics.json
  report.py      report.md and the plots, from the sweep's metrics
  request_params.py  every request's sampling parameters, pinned in full, with derived seeds
  context.py     the prompt-length buckets (--bench-context)
  agreement.py   the agreement check: an engine's per-round acceptance against 05's replay
  deploy.py      what to deploy from the sweep's numbers, with load_model.py (verify cost against load)

Imports the stage contract, common.text, common.target, common.draft and common.benchmark (05's replay,
sampling and formatting, which the agreement check and the sweep reuse); nothing below imports it.
"""
