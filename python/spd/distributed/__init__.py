"""The distributed runtime: n stage ranks and one draft rank on torch.distributed.

Roles (n + 1 of them; each a process of its own, or with --draft-on-stage S the draft rank and
  stage S share process 0, see config.Placement):
  rank 0      the draft rank: PDM, anchor buffers and feature aggregation, the sampler and the
              verifier under sampling, the pipeline schedule; it sends the units.
  rank s + 1  stage s: its decoder layers and their KV cache (stage 0 also embeds the token that
              enters the pipeline, from its id; stage 0 and rank 0 both keep the embedding table).

Where verification runs: greedy, on the last stage (Stage.run with a draft: final norm + LM head
+ argmax fused after its layers, where the hidden state already is), which sends rank 0 the
verdict (two ints) instead of its hidden row; rank 0 keeps the PDM, the context lookup and the
generator. Under sampling the last stage sends its output row and rank 0 judges (q and the one
random stream live there).

One cycle is `spd.runtime.sequence.SequenceDecode.run`, the loop the single-process engine runs
too (rank 0 gives it `draft_rank.RemoteStages`: same schedule, same draw order of the generator,
so greedy tokens, N and K and seeded samples are identical). Decode is a stream of units
(spd.distributed.protocol): each token rank 0 puts into the pipeline is one unit, which every
stage runs as soon as its input arrives, in order:
  rank 0: take the anchor rows the stages sent up to last cycle (pre-step features), draft; while
          filling, send the draft to stage 0 as the next unit; when full, send it at once as if
          it will be accepted (speculative control), then read the last stage's verdict on the
          oldest in-flight token: the one host read of an accepted cycle. A rejection drops the
          in-flight units and sends the correction, whose lower position rolls every stage back.
  stage s: receive a unit from its one source (rank 0 for stage 0, stage s - 1 after it): a
          host header [op, seq] on gloo and a payload on the data group ([position, token] at
          stage 0, [position | row] after it); post the next receives, set its cache length to
          the position (lower after a rollback: the truncation), run its layers, send its
          anchors to rank 0 and header + packed [position | output] to stage s + 1. It reads
          only the header on the host (host memory: no device wait), and waits on nothing from
          rank 0 but the data itself.
Units rank 0 dropped still run on every stage, in cycles they would idle anyway; rank 0 drops
their messages. With speculative control off rank 0 reads the verdict before it sends the next
unit (stage 0 then waits for it). The end of a generation is a stop header rank 0 sends to
stage 0 and each stage passes on. Every receive names its sender.
Every receive is posted ahead of need (gloo sends complete once the receiver has posted) and
sends are waited lazily.

Requests and statistics go through the rendezvous store; how failures are detected and blamed
(heartbeats, failure records, the watchdog, SIGTERM from outside) is told in `faults`.

Modules, each importing only those above it:
  config      DistConfig, SpeculationPolicy, GenerateRequest, parse_fault, role_of
  protocol    message tags, the unit messages' layout and each stage's snap (SnapFormat)
  emulate     emulated compute (fixed waits) for protocol tests and benchmarks
  faults      exit statuses, failure records and blame, SIGTERM, the heartbeat watchdog
  transport   Runtime (the stores, process groups), Endpoint (one role's point-to-point, host
              staging) and Mailbox (messages between the two roles of one process)
  handshake   the consistency check every rank passes before the first message
  stats       the per-cycle breakdown rank 0 reports
  stage_rank  StageWorker: one stage's loop
  draft_rank  DistributedSPDEngine and RemoteStages: rank 0's side of the cycle, its streams
  rank        one rank's whole life (run_rank) and rank-0 jobs
  launch      the local launcher and torchrun entry (imports the rest lazily)
"""
