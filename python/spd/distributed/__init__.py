"""The distributed runtime: n stage ranks and one draft rank on torch.distributed.

Roles (n + 1 of them; each a process of its own, or with --draft-on-stage S the draft rank and
  stage S share process 0, see config.Placement):
  rank 0      the draft rank: the PDM, the anchor buffers, the judge and the cycle's control
              (spd.runtime.cycle), the sampler and the generator.
  rank s + 1  stage s: its decoder layers and their KV cache (stage 0 embeds the tokens that
              enter the pipeline; the last stage holds the final norm and LM head, as a greedy
              chain's last stage judges after its layers).

Every rank runs the same cycles, in lock-step: the one cycle of spd.runtime.cycle on rank 0,
whose stages are `draft_rank.RemoteStages`, and `stage_rank.StageCycles` on each stage rank.
In cycle c rank 0 sends stage 0 its unit (spd.runtime.unit) and receives every stage's snap;
stage s runs the unit stage s - 1 ran in cycle c - 1, sends rank 0 its snap and stage s + 1 the
unit with its output rows (spd.distributed.messages). No rank reads a message on the host to
know what to run, and every message of a cycle is waited for within it, so under NCCL each
rank's cycle is one CUDA graph, messages included. The end is a cycle number that travels with
the units (Cycle, `END`).

Requests and statistics go through the rendezvous store; how failures are detected and blamed
(heartbeats, failure records, the watchdog, SIGTERM from outside) is told in `faults`.

Modules, each importing only those above it:
  config      DistConfig, GenerateRequest, parse_fault, role_of
  messages    message tags and the snaps' layout
  emulate     emulated compute (fixed waits) for tests and benchmarks
  faults      exit statuses, failure records and blame, SIGTERM, the heartbeat watchdog
  transport   Runtime (the stores, the process group), Endpoint (a process's point-to-point
              messages, host staging)
  handshake   the consistency check every rank passes before the first message
  stats       the per-cycle breakdown rank 0 reports
  stage_rank  StageWorker, StageCycles: a stage's prefill and cycles
  draft_rank  DistributedSPDEngine and RemoteStages: rank 0's side of the cycle
  batch_stage a batch session (several sequences at once): its messages, a stage rank's side
  session     SessionDriver, run_session: rank 0's side of a batch session's protocol
  batch_draft DistributedBatch: rank 0's side of an SPD batch session
  batch_pipeline  DistributedPipeline: the pipeline without speculation as a batch session
  rank        one rank's whole life (run_rank) and rank-0 jobs
  launch      the local launcher and torchrun entry (imports the rest lazily)
"""
