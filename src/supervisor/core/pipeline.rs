//! The release pipeline of one lease: its start, the proofs of its worker's physical end as
//! they arrive (or miss their bound: quarantine), the temp dir's removal, the broker release
//! token by token, and its caller's answer.

use std::io;

use super::Core;
use super::protocol::{Answer, ControlId, Effect, LeaseKey, ProcessKey, Reply, WaiterId};
use super::record::{
    Caller, Holder, Proof, Proofs, Reason, Release, Removal, Renewal, Replacer, Stop, Why,
};
use crate::broker::SlotToken;
use crate::error::{AcquireError, CleanupError, PrepareError};
use crate::paths::TempDir;

/// Where `advance` moves a lease.
enum Step {
    Stay,
    RemoveTempDir(TempDir),
    /// A temp dir removal is owed, but no dir was ever named (an illegal state).
    NoDir,
    Release,
}

impl Core {
    pub(super) fn started(&mut self, key: LeaseKey, device: Option<usize>) {
        let serving = self.ending.is_serving();
        let cancel = self.book.edit(key, |r| {
            if r.holder != Holder::Job {
                return None;
            }
            if let Some(d) = device {
                r.owed.add(Proof::GpuFence);
                r.device = Some(d);
            }
            // The job's driver removes its temp dir (or reports it never made one).
            r.removal = Removal::Driver;
            // Granted just as shutdown began: cancelled with the rest.
            Some(!serving && r.stop == Stop::Running)
        });
        match cancel.flatten() {
            None => self
                .fx
                .illegal(format_args!("started lease {key} is not a live job")),
            Some(true) => self.cancel_for_shutdown(key),
            Some(false) => {}
        }
    }

    /// The job could not start (no worker, no GPU sub-slot): nothing physical is owed; its
    /// caller hears why once its slots are back.
    pub(super) fn not_started(&mut self, key: LeaseKey, why: PrepareError) {
        let fits = self.book.edit(key, |r| {
            let fits = r.holder == Holder::Job && !r.is_releasing();
            if fits {
                r.owed.forgive_all();
                r.unprepared = Some(Box::new(why));
            }
            fits
        });
        if fits != Some(true) {
            return self.fx.illegal(format_args!(
                "lease {key} that did not start is not a live job"
            ));
        }
        self.advance(key);
    }

    /// The worker could not prepare the job: no body ran; the worker's end is still owed.
    pub(super) fn unprepared(&mut self, key: LeaseKey, why: PrepareError) {
        let fits = self.book.edit(key, |r| {
            let fits = r.holder == Holder::Job;
            if fits {
                r.unprepared.get_or_insert_with(|| Box::new(why));
            }
            fits
        });
        if fits != Some(true) {
            self.fx
                .illegal(format_args!("unprepared lease {key} is not a live job"));
        }
    }

    pub(super) fn proven(&mut self, key: LeaseKey, proofs: Proofs, process: Option<ProcessKey>) {
        let temp_dir = proofs.contains(Proof::TempDir);
        let fits = self.book.get(key).is_some_and(|r| {
            r.owed.owes_all(proofs)
                && process.is_none_or(|p| r.owed.owes(Proof::Process(p)))
                // The temp dir is proven removed only by the removal the core asked for.
                && (!temp_dir || r.removal == Removal::Running)
        });
        if !fits {
            return self.fx.illegal(format_args!(
                "proof {proofs:?}/{process:?} for lease {key}, which does not owe it"
            ));
        }
        self.book.edit(key, |r| {
            r.owed.clear(proofs);
            if temp_dir {
                r.removal = Removal::NotStarted;
            }
            if let Some(p) = process {
                r.owed.clear_process(p);
            }
            r.drop_answered_reasons();
        });
        if proofs.contains(Proof::WorkerJoined) {
            // The body's result exists now: a quarantine found earlier is answered.
            self.answer_early(key);
        }
        self.advance(key);
    }

    /// A job's driver ended: its last proofs, and the temp dir the job asked for. The dir is
    /// removed (`advance`) once the worker's physical end is proven: here, or when the last
    /// unproven proof arrives.
    pub(super) fn ended(&mut self, key: LeaseKey, proofs: Proofs, dir: Option<TempDir>) {
        let fits = self.book.get(key).is_some_and(|r| {
            r.holder == Holder::Job && r.removal == Removal::Driver && r.owed.owes_all(proofs)
        });
        if !fits {
            return self.fx.illegal(format_args!(
                "driver's end {proofs:?}/{dir:?} for lease {key}, which does not owe it"
            ));
        }
        self.book.edit(key, |r| {
            r.owed.clear(proofs);
            r.removal = Removal::NotStarted;
            if dir.is_none() {
                // Never asked for: nothing is owed for it.
                r.owed.clear(Proofs::of(Proof::TempDir));
            }
            r.dir = dir;
            r.drop_answered_reasons();
        });
        if proofs.contains(Proof::WorkerJoined) {
            self.answer_early(key);
        }
        self.advance(key);
    }

    /// A proof is missing past its bound, or cannot be made: quarantine, and tell the caller.
    pub(super) fn missing(
        &mut self,
        key: LeaseKey,
        proof: Proof,
        why: Why,
        detail: String,
        io: Option<io::Error>,
    ) {
        let fits = self.book.edit(key, |r| {
            if !r.owed.owes(proof) || r.is_releasing() {
                return false;
            }
            // One reason per proof: the newest says most (a loss after a late fence, say).
            r.reasons.retain(|x| x.proof != proof);
            r.reasons.push(Reason { proof, why, detail });
            if io.is_some() {
                r.io = io.map(super::record::KeptIo);
            }
            true
        });
        if fits != Some(true) {
            return self.fx.illegal(format_args!(
                "{proof:?} missing for lease {key}, which does not owe it"
            ));
        }
        self.answer_early(key);
    }

    pub(super) fn temp_dir_failed(&mut self, key: LeaseKey, detail: String, error: io::Error) {
        let fits = self.book.edit(key, |r| {
            let fits = r.removal == Removal::Running;
            if fits {
                r.removal = Removal::Failed;
            }
            fits
        });
        if fits != Some(true) {
            return self.fx.illegal(format_args!(
                "temp dir removal failed for lease {key}, which was not removing it"
            ));
        }
        self.missing(key, Proof::TempDir, Why::Unproven, detail, Some(error));
    }

    /// A quarantined job answers its caller at once, without waiting for what may never be
    /// proven, but not before its worker has joined: the answer carries the body's own result,
    /// which exists only once the body has ended.
    fn answer_early(&mut self, key: LeaseKey) {
        let answer = self.book.edit(key, |r| {
            if r.caller == Caller::Answered
                || r.holder != Holder::Job
                || r.reasons.is_empty()
                || r.owed.owes(Proof::WorkerJoined)
            {
                return None;
            }
            r.caller = Caller::Answered;
            Some(Answer::Job {
                unprepared: r.unprepared.take(),
                cleanup: Err(r.unconfirmed()),
            })
        });
        if let Some(answer) = answer.flatten() {
            self.fx.push(Effect::Answer { key, answer });
        }
    }

    pub(super) fn device_lost(
        &mut self,
        key: LeaseKey,
        device: usize,
        generation: u64,
        reason: String,
        replacer: Replacer,
    ) {
        self.missing(
            key,
            Proof::GpuFence,
            Why::Lost {
                device,
                generation,
                replacer,
            },
            format!("gpu device {device} lost: {reason}"),
            None,
        );
        // The slot is needed back: replace the device (or learn it already was).
        self.fx.push(Effect::RecreateDevice { device });
    }

    pub(super) fn device_replaced(&mut self, device: usize, now: u64) {
        let keys = self.book.keys_where(|r| {
            r.reasons.iter().any(|x| {
                matches!(x.why, Why::Lost { device: d, generation, .. } if d == device && generation <= now)
            })
        });
        for key in keys {
            // The old device is gone, and its work with it.
            self.proven(key, Proofs::GPU, None);
        }
    }

    pub(super) fn release_requested(&mut self, key: LeaseKey) {
        match self.book.get(key) {
            // Already released (by an earlier call, or at shutdown): a no-op.
            None => self.fx.push(Effect::Answer {
                key,
                answer: Answer::Released(Ok(())),
            }),
            Some(r) if r.holder == Holder::Explicit && !r.is_releasing() => self.start_release(key),
            // In flight: the caller joins the answer still to come.
            Some(r) if r.holder == Holder::Explicit => {}
            Some(_) => self
                .fx
                .illegal(format_args!("release requested for job lease {key}")),
        }
    }

    pub(super) fn lease_lost(&mut self, key: LeaseKey, reason: String) {
        let effect = self.book.edit(key, |r| {
            if r.renewal != Renewal::Running {
                // Renewal had stopped: the release has begun, nothing to act on.
                return None;
            }
            r.renewal = Renewal::Off;
            let holder = r.holder;
            Some(match holder {
                // The job's work may still run (its body, tasks, processes or gpu work): it is
                // cancelled and its result says the lease was lost.
                Holder::Job if r.owed.work_running() => {
                    r.stop = Stop::Cancelled;
                    Effect::Cancel {
                        key,
                        holder,
                        lost: Some(reason),
                    }
                }
                Holder::Explicit => Effect::Cancel {
                    key,
                    holder,
                    lost: Some(reason),
                },
                _ => Effect::LostAfterExit { key, reason },
            })
        });
        if let Some(effect) = effect.flatten() {
            self.fx.push(effect);
        }
    }

    /// Moves a lease on as far as its proofs allow: temp dir removal once the worker is
    /// physically done, the broker release once nothing else is owed.
    pub(super) fn advance(&mut self, key: LeaseKey) {
        let step = self.book.edit(key, |r| {
            if r.is_releasing() {
                Step::Stay
            } else if r.owed.physically_done()
                && r.owed.owes(Proof::TempDir)
                && r.removal == Removal::NotStarted
            {
                match r.dir.clone() {
                    Some(dir) => {
                        r.removal = Removal::Running;
                        Step::RemoveTempDir(dir)
                    }
                    // Only a job's end report names the dir, and it clears the proof when
                    // there is none.
                    None => Step::NoDir,
                }
            } else if r.owed.is_empty() && r.holder == Holder::Job {
                Step::Release
            } else {
                Step::Stay
            }
        });
        match step {
            Some(Step::RemoveTempDir(dir)) => self.fx.push(Effect::RemoveTempDir { key, dir }),
            Some(Step::NoDir) => self.fx.illegal(format_args!(
                "lease {key} owes a temp dir removal, but no end report named its dir"
            )),
            Some(Step::Release) => self.start_release(key),
            Some(Step::Stay) | None => {}
        }
    }

    /// Starts the broker release of every token of the lease. The supervisor's own pool takes
    /// its slots back in this step, so such a lease ends here (its answer queued); any other
    /// broker is asked by effect and answers as [`Input::Released`].
    pub(super) fn start_release(&mut self, key: LeaseKey) {
        let fx = &mut self.fx;
        let on_pool = self.admission.pool.is_some();
        let tokens = self.book.edit(key, |r| {
            r.release = Release::Releasing {
                left: r.slots() as u32,
                error: None,
            };
            r.reasons.clear();
            if r.renewal == Renewal::Running {
                r.renewal = Renewal::Off;
                fx.push(Effect::StopRenewal { key });
            }
            if on_pool {
                // No allocation for one slot: `more` is then empty.
                return Some((r.token, r.more.clone()));
            }
            for token in r.tokens() {
                fx.push(Effect::Release { key, token });
            }
            None
        });
        if let Some(Some((token, more))) = tokens {
            for token in std::iter::once(token).chain(more) {
                self.give_to_pool(key, token);
            }
        }
    }

    /// One token of the lease given back to the supervisor's own pool, answered at once.
    fn give_to_pool(&mut self, key: LeaseKey, token: SlotToken) {
        let Some(pool) = self.admission.pool.as_mut() else {
            // As `take_from_pool`: a defect, reported, never a panic in the supervisor's turn.
            return self.fx.illegal(format_args!(
                "{token} of lease {key} given back to a pool this core does not own"
            ));
        };
        let given = pool.give(token);
        self.released(key, given.map_err(|e| CleanupError::broker(token, e)));
    }

    /// One token's broker release answered. Each slot is counted as its own release answers;
    /// the lease ends when the last one has, its first failure being its result.
    pub(super) fn released(&mut self, key: LeaseKey, result: Result<(), CleanupError>) {
        let left = match self.book.get(key).map(|r| &r.release) {
            // `left` never reaches 0: the record goes with its last release.
            Some(Release::Releasing { left, .. }) => *left,
            _ => {
                return self.fx.illegal(format_args!(
                    "release of lease {key}, which was not releasing"
                ));
            }
        };
        match &result {
            Ok(()) => self.counters.released_total += 1,
            Err(_) => self.counters.release_failed_total += 1,
        }
        if left > 1 {
            self.book.edit(key, |r| {
                if let Release::Releasing { left, error } = &mut r.release {
                    *left -= 1;
                    if let Err(err) = result {
                        error.get_or_insert_with(|| Box::new(err));
                    }
                }
            });
            return;
        }
        // The last token is back: the lease ends (one look-up, no edit in between: the hot
        // path of every single-slot lease).
        let Some(record) = self.book.remove(key) else {
            return;
        };
        let result = match record.release {
            Release::Releasing {
                error: Some(first), ..
            } => Err(*first),
            _ => result,
        };
        let answer = match (record.holder, record.caller) {
            (Holder::Job, Caller::Waiting) => Some(Answer::Job {
                unprepared: record.unprepared,
                cleanup: result,
            }),
            (Holder::Explicit, _) => Some(Answer::Released(result)),
            // Answered early, or nobody to answer: a failure goes to the sink.
            (Holder::Job, Caller::Answered) | (Holder::Surplus, _) => {
                if let Err(error) = result {
                    self.fx.push(Effect::Sink { key, error });
                }
                None
            }
        };
        if let Some(answer) = answer {
            self.fx.push(Effect::Answer { key, answer });
        }
        self.fx.push(Effect::Forget { key });
    }

    /// `Supervisor::cancel`: every job with the id that waits, or holds a lease not yet
    /// releasing (a cancel is a request: the slot returns through the pipeline).
    pub(super) fn cancel_by_id(
        &mut self,
        control: ControlId,
        waiters: Box<[WaiterId]>,
        leases: Box<[LeaseKey]>,
    ) {
        let mut found = false;
        for waiter in waiters {
            found |= self.withdraw(waiter, AcquireError::Cancelled);
        }
        for key in leases {
            let Some(r) = self.book.get(key) else {
                continue;
            };
            if r.holder != Holder::Job || r.is_releasing() {
                continue;
            }
            found = true;
            if r.stop == Stop::Running {
                self.book.edit(key, |r| r.stop = Stop::Cancelled);
                self.fx.push(Effect::Cancel {
                    key,
                    holder: Holder::Job,
                    lost: None,
                });
            }
        }
        self.fx.push(Effect::Reply {
            control,
            reply: Reply::Cancelled(found),
        });
    }

    /// Shutdown cancels a job not cancelled yet (counted once in the report).
    pub(super) fn cancel_for_shutdown(&mut self, key: LeaseKey) {
        self.book.edit(key, |r| r.stop = Stop::Cancelled);
        self.ending.tally.cancelled_jobs += 1;
        self.fx.push(Effect::Cancel {
            key,
            holder: Holder::Job,
            lost: None,
        });
    }
}
