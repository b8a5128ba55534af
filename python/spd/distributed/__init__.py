"""The distributed runtime: n stage ranks and one draft rank on torch.distributed.

Roles (world size n + 1):
  rank 0      the draft rank: PDM, anchor buffers and feature aggregation, the verifier (final norm
              and LM head), the sampling generator, the pipeline schedule, and the control plane.
  rank s + 1  stage s: its decoder layers and their KV cache (stage 0 also embeds the token that
              enters the pipeline, from its id; stage 0 and rank 0 both keep the embedding table).

Why the verifier sits on the draft rank: judging a draft needs the draft distribution q and the
one random stream, both of which live where the draft is made, and the decision is what the
control message carries; on the last stage the LM head (vocab x d, larger than a layer of a small
model) would lengthen the slowest stage every cycle instead of running while the draft rank is
otherwise idle waiting for the pipeline. The last stage therefore sends its final hidden state
(one row) with its anchor states, and rank 0 applies norm + LM head.

One cycle, as `SPDEngine.generate` runs it (both drive the same `spd.runtime.sequence.SequenceDecode`:
same schedule, same draw order of the generator, so greedy tokens, N and K and seeded samples are
identical):
  rank 0: send control (window start/count, truncation, token entering stage 0) to every stage;
          post receives for this cycle's anchor snaps; wait for last cycle's snaps (pre-step
          features) and draft while the stages compute; if the window is full wait for the last
          stage's row and verify; the decision goes into the next cycle's control message.
  stage s: wait for control; truncate on rollback; if it has a token (s < count) take its input
          (the embedding, or the hidden state the previous stage sent last cycle), run its layers,
          send its anchor states (and, last stage, the output row) to rank 0 and the output to
          stage s + 1 with non-blocking sends.
Speculative control (SpeculationPolicy): in a full cycle rank 0 may send the next cycle's control
message right after drafting, as if the draft will be accepted, so the stages compute the next
cycle while rank 0 waits for the last stage and verifies. If the draft is rejected, rank 0 sends
that cycle's message again with the rollback (a stage sees the same cycle number twice and treats
the second as the cycle: truncate, discard the inputs the first attempt produced) and receives
and drops the first attempt's snaps. Control messages therefore alternate tags by their sequence
number, not by cycle; point-to-point order per peer and tag keeps the two attempts apart.
Gloo point-to-point sends complete only once the receiver has posted its receive, so every
receive is posted ahead of need (control one cycle ahead, hidden states when the sender's work is
announced) and sends are waited lazily: the protocol never waits in a cycle.

Requests and statistics go through the rendezvous store; how failures are detected and blamed
(heartbeats, failure records, the watchdog, SIGTERM from outside) is told in `faults`.

Modules, each importing only those above it:
  config      DistConfig, SpeculationPolicy, GenerateRequest, parse_fault, role_of
  protocol    message tags and the control message's fields
  faults      exit statuses, failure records and blame, SIGTERM, the heartbeat watchdog
  transport   Runtime: the stores, process groups and point-to-point with host staging
  handshake   the consistency check every rank passes before the first message
  stats       the per-cycle breakdown rank 0 reports
  stage_rank  StageWorker: one stage's loop
  draft_rank  DistributedSPDEngine: rank 0's loop and its CUDA streams
  rank        one rank's whole life (run_rank) and rank-0 jobs
  launch      the local launcher and torchrun entry (imports the rest lazily)
"""
