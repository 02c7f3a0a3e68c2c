"""Asynchronous RL with bounded staleness (rl.max_staleness = N >= 1) on the separated placement: the generation
workers decode later iterations' batches while the training workers update.

The schedule is decided by counts, never by timing. After v updates (at the start of iteration v) the trainer's
weights (version v) go to the generation workers, and the batch of iteration v + N is queued behind them; on a fresh
start the batches 0..N are queued behind version 0. So the batch of iteration i is decoded by the weights of update
max(0, i - N), whichever worker is faster: Ray runs an actor's calls in the order they were made, so a generator
that is still decoding finishes that batch with the weights it had, and loads the new ones after. The trainer waits
for a batch that is late; the generator never waits (N batches are queued ahead of it). Every sample is therefore
trained by a policy at most N updates newer than the one that drew it (exp.staleness), and the update corrects with
the decoupled PPO objective (rlfuse/algos/offpolicy.py): the proximal policy is the trainer's weights at the start of
the update (their log-probs taken in the scoring pass just before it), the behaviour policy the sampler's recorded
log-probs.

A batch is scored (reward, critic values) on the training workers just before its update, in (prompt, sample)
order: its values come from the critic that trains on it, as in the synchronous loop. The reference's log-probs are
taken where the batch was decoded, by the generation workers, in the time they would otherwise wait for the trainer
(RolloutSettings.reference_on_decoders; a generation worker then holds a frozen copy of the reference). A batch is trained
whole, never by finishing order, so short answers are not favoured (rollout/mean_length_trained against
rollout/mean_length_generated says so every iteration). At a checkpoint the batches generated ahead are written
beside it (checkpoint.pt.inflight, unscored samples and the version that drew them), so `--resume` trains the very
samples the uninterrupted run would: the resumed run's weights equal it (tested).

Partial rollouts (rl.partial_rollout_after = F >= 1): a batch that will be stale when trained decodes under its
first version until F of its samples (per generation worker) have finished, then parks the rest
(DecodeEngine.export_state); the rest is queued behind the next version's weights and continues under them
(re-prefilled: prompt + tokens so far), each sample recording from which token the new weights sampled it
(Sample.switch_at). The switch point is a count, and a generator that reaches it before the next weights exist waits
for them (its next call is queued behind them): fresher samples for less overlap. A parked rest is written into the
checkpoint too. What it does not do yet: more than one switch per batch (rl.max_staleness >= 2 switches once, to
the next version), and tail migration between generation workers in this mode.

Dynamic sampling (rl.dynamic_sampling): an iteration's further draws of prompt groups are decoded when the trainer
asks for them, by the weights of the iteration being trained (staleness 0), behind the batches already queued.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

from rlfuse.config import RLConfig
from rlfuse.files import atomic_path
from rlfuse.learn.checkpoint import save_torch
from rlfuse.rollout.fusion import build_experience, scores_proximal
from rlfuse.rollout.state import RolloutRequest, Sample

IN_FLIGHT_SUFFIX = ".inflight"


@dataclass
class InFlight:
    """One batch generated ahead: the weights version that decodes it (its first part, for a partial rollout) and
    its samples as they come."""
    version: int
    refs: list = field(default_factory=list)
    """Object refs of the decoding calls not yet gathered (MultiWorkerRollout.submit_decode, submit_continue)."""
    samples: list[Sample] = field(default_factory=list)
    partial: bool = False
    """A partial rollout: after rl.partial_rollout_after finished samples per worker, the rest continues under
    version + 1."""
    continued: bool = False
    """The rest was queued behind version + 1 (submit_continue)."""
    parked: list | None = None
    """The parked rests read back from a checkpoint (one per decoder), handed to the workers with the continuation."""
    decode_s: list[float] = field(default_factory=list)
    reference_s: float = 0.0
    """The generation workers' reference pass over the batch (inside decode_s)."""
    prefill_tokens: int = 0
    """The tokens the decoders prefilled for it (rollout/prefill_tokens; a part decoded before a resume uncounted)."""
    rss_mb: list = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.refs and (not self.partial or self.continued)


class AsyncRollout:
    """The rollout object of trainers/rl.py (runtime/protocols.py) for rl.max_staleness >= 1: a RayRollout's
    workers and weight transfer, with decoding queued ahead by the schedule above."""

    def __init__(self, base, requests, rl: RLConfig, log=print):
        self.base, self.requests, self.N, self.iterations, self.log = base, requests, rl.max_staleness, rl.iterations, log
        self.partial_after = rl.partial_rollout_after
        """rl.partial_rollout_after (0: every batch decoded whole by one version)."""
        self.rl = rl
        self.version = -1
        """Updates done when sync_weights was last called (the weights the generators got last)."""
        self.in_flight: dict[int, InFlight] = {}
        self.loads: list = []
        """The last weight push's load calls, queued on the generators (checked at the next one)."""

    @property
    def driver(self):
        return self.base.driver

    def sync_weights(self, models=None) -> dict:
        """Version v = this call's count (the iteration about to train): its weights go to the generation workers
        without waiting for them (they load them after the calls already queued); behind them, the rests of the
        partial rollouts started under version v - 1, then the batches due: v + N, and on a fresh start everything
        from v (a batch that will be stale when trained is a partial rollout where rl.partial_rollout_after says)."""
        self.version = v = self.version + 1
        w = self.base.workers
        t = time.perf_counter()
        with w.naming_dead_workers("weight sync"):
            ray.get(self.loads)  # the previous push's loads ran (a failure there surfaces now)
            self.base.group.begin_rollout()  # sharded training: the whole weights, to send and to score with
            adapters = self.base.adapters  # rollout.weight_sync: the adapters alone, merged by each worker
            refs = self.base.group.actor_weights(self.driver.bucket_bytes, "actor", adapters)
            self.loads = [w.handles[i].load_weights.remote("adapter" if adapters else "generator", ref)
                          for ref in refs.refs for i in w.decoders]
            self.loads += [w.handles[i].merge_adapter.remote() for i in w.decoders] if adapters else []
            for i, batch in sorted(self.in_flight.items()):
                if batch.partial and not batch.continued and batch.version == v - 1:
                    batch.refs += self.driver.submit_continue(i, batch.parked)
                    batch.continued, batch.parked = True, None
            for i in range(v, min(v + self.N, self.iterations - 1) + 1):
                if i not in self.in_flight:
                    partial = bool(self.partial_after) and v < i
                    self.in_flight[i] = InFlight(v, self.driver.submit_decode(
                        self.requests(i), self.partial_after if partial else 0), partial=partial)
        return {"time/weight_sync": time.perf_counter() - t, "sync/bytes": refs.bytes, "sync/sent_bytes": refs.bytes}

    def _gather(self, batch: InFlight) -> InFlight:
        """The batch's decoding calls so far gathered into its samples (waiting for them)."""
        if batch.refs:
            chunks = ray.get(batch.refs)
            batch.samples += [x for c in chunks for x in c.unscored]
            D = len(self.driver.decoders)
            busy = [sum(c.busy_s for c in chunks[j::D]) for j in range(D)]
            batch.decode_s = [a + b for a, b in zip(batch.decode_s, busy)] if batch.decode_s else busy
            batch.reference_s += sum(c.reference_s for c in chunks)
            batch.prefill_tokens += sum(c.prefill_tokens for c in chunks)
            batch.rss_mb, batch.refs = [c.rss_mb for c in chunks[-D:]], []
        return batch

    def _decoded(self, i: int) -> InFlight:
        """Batch i with all its samples (waiting for its decoders if they are not done)."""
        batch = self._gather(self.in_flight[i])
        if not batch.complete:  # the schedule queues every continuation before the batch is trained
            raise RuntimeError(f"asynchronous rollout: batch {i} (partial, from version {batch.version}) was not "
                               f"continued before its update at version {self.version}")
        return batch

    def _refill(self, request: RolloutRequest) -> InFlight:
        """rl.dynamic_sampling's further draw for the iteration being trained, decoded now by this version's weights
        (queued behind the batches already ahead, so it waits for them: a count, not a timing, decides its weights)
        and never saved with a checkpoint (the iteration that asked for it ends before the next one)."""
        return self._gather(InFlight(self.version, self.driver.submit_decode(request, 0)))

    def generate(self, request: RolloutRequest):
        """The batch of request.iteration, queued earlier (sync_weights), scored now on the training workers."""
        i, t0 = request.iteration, time.perf_counter()
        with self.base.workers.naming_dead_workers("rollout"):
            batch = self._refill(request) if request.draw else self._decoded(i)
            t1 = time.perf_counter()
            samples = sorted(batch.samples, key=lambda x: (x.prompt_id, x.sample_index))  # the experience's order
            # a sample's staleness is its oldest token's: a partial rollout's sample drew from the next version only
            # when it had not started before the switch (switch_at 0)
            ages = [self.version - batch.version - (x.switch_at == 0) for x in samples]
            # a stale batch is scored with the proximal log-probs (the training workers' actor as it is now), as the
            # synchronous loop scores a batch sampled in other arithmetic
            one_step = self.rl.optimiser_steps(len(samples)) == 1
            proximal = scores_proximal(any(ages), one_step, self.rl.kl_coef)
            scored, chunks = self.driver.score_in_order(samples, request.params.temperature, proximal=proximal)
        if not request.draw:
            del self.in_flight[i]
        exp = build_experience(scored)
        exp.proximal_from_update = any(ages) and not proximal
        if len(exp) != len(request.prompts) * request.k:
            raise RuntimeError(f"asynchronous rollout returned {len(exp)} samples for iteration {i}, expected "
                               f"{len(request.prompts) * request.k}")
        exp.staleness = torch.tensor(ages)
        generated = [len(s.token_ids) for s in samples]
        after = sum(len(x.token_ids) - x.switch_at for x in samples if x.switch_at is not None)
        exp.timing = {"rollout": time.perf_counter() - t0, "scoring": sum(c.score_s for c in chunks.values()),
                      "proximal": sum(c.proximal_s for c in chunks.values()), "wait_for_batch": t1 - t0,
                      "decode_s": sum(batch.decode_s), "reference_on_decoders": batch.reference_s,
                      "prefill_tokens": batch.prefill_tokens,
                      "mean_length_generated": sum(generated) / len(generated),
                      "tokens_next_version": after / max(1, sum(generated)), "decode_rss_mb": batch.rss_mb,
                      "busy": {w: c.score_s for w, c in chunks.items()} | dict(zip(self.driver.decoders,
                                                                                 batch.decode_s))}
        return exp

    def metrics(self, exp) -> dict:
        """time/wait_for_batch (the seconds the trainer waited for its batch: 0 when generation kept ahead),
        time/decode (the generation workers' seconds on it), the staleness histogram, the length-bias pair, and
        the workers' memory (generation workers' as of their last batch: asking now would wait behind the queue)."""
        t, w = exp.timing, self.base.workers
        ages = exp.staleness.tolist()
        out = {"time/rollout": t["rollout"], "time/scoring": t["scoring"], "time/wait_for_batch": t["wait_for_batch"],
               "time/decode": t["decode_s"], "async/staleness_mean": sum(ages) / len(ages),
               "async/staleness_max": max(ages), "async/batches_ahead": len(self.in_flight),
               "rollout/mean_length_generated": t["mean_length_generated"],
               "rollout/mean_length_trained": float(exp.mask.sum(1).mean())}
        if self.partial_after:
            out["async/tokens_next_version"] = t["tokens_next_version"]
        if exp.proximal_logprobs is not None:  # inside time/scoring
            out["time/proximal_logprobs"] = t["proximal"]
        if t["reference_on_decoders"]:  # inside time/decode
            out["time/reference_on_decoders"] = t["reference_on_decoders"]
        out |= {f"async/staleness_{a}": ages.count(a) / len(ages) for a in range(self.N + 1)}
        with w.naming_dead_workers("rollout"):
            free = [i for i in range(len(w.handles)) if i not in w.decoders]
            rss = dict(zip(free, ray.get([w.handles[i].rss_mb.remote() for i in free])))
            rss |= dict(zip(w.decoders, t["decode_rss_mb"]))  # none for a batch restored from a checkpoint
            out |= self.driver.reward_metrics()
        for i, rank in enumerate(w.ranks):
            out[f"worker/{rank}/busy_s"] = t["busy"].get(i, 0.0)  # decoding this batch, or scoring it
            if i in rss:
                out[f"worker/{rank}/rss_mb"], out[f"worker/{rank}/rss_peak_mb"] = rss[i]
        return out

    def save_in_flight(self, path: Path, iteration: int) -> None:
        """The batches generated ahead (waiting for their decoding calls to end; a partial rollout not yet continued
        with the parked rest of each worker), written atomically beside the checkpoint of `iteration`; the previous
        file is kept as .prev until the trainer's checkpoint is written (a kill in between resumes from the previous
        checkpoint, which then finds its own batches)."""
        batches = {}
        for i, batch in sorted(self.in_flight.items()):
            self._gather(batch)
            parked = batch.parked
            if batch.partial and not batch.continued and parked is None:
                parked = self.driver.parked_states(i)
            batches[i] = {"version": batch.version, "samples": batch.samples, "partial": batch.partial,
                          "continued": batch.continued, "parked": parked}
        current = Path(f"{path}{IN_FLIGHT_SUFFIX}")
        if current.exists():
            os.replace(current, current.with_name(current.name + ".prev"))
        with atomic_path(current) as tmp:
            save_torch({"iteration": iteration, "batches": batches}, tmp)

    def begin_at(self, path: Path, iteration: int) -> None:
        """The run starts at `iteration` (0, or a resumed checkpoint's): the next sync_weights is that version,
        and a resumed run takes back the batches saved beside its checkpoint; without them (a checkpoint of a
        synchronous run) the next ones are decoded afresh by the resumed weights, and the log says so."""
        self.version = iteration - 1
        if iteration == 0:
            return
        for f in (Path(f"{path}{IN_FLIGHT_SUFFIX}"), Path(f"{path}{IN_FLIGHT_SUFFIX}.prev")):
            if f.exists():
                saved = torch.load(f, weights_only=False)
                if saved["iteration"] == iteration:
                    self.in_flight = {i: InFlight(b["version"], samples=b["samples"], partial=b["partial"],
                                                  continued=b["continued"], parked=b["parked"])
                                      for i, b in saved["batches"].items()}
                    return
        self.log(f"[rl] no batches in flight saved with the checkpoint of iteration {iteration}: the next "
                 f"{self.N} are decoded by the resumed weights (less stale than the uninterrupted run's)")
