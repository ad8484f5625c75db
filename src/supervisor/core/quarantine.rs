//! Quarantine and reclaim. A quarantined lease holds its slots, counted and listed with its
//! reasons, until each missing proof arrives on its own (a late one), its device is replaced
//! (a lost one), or a re-check proves it (an unproven one: a process group that may have
//! escaped, a temp dir that could not be removed).

use super::Core;
use super::protocol::{ControlId, Effect, LeaseKey, QuarantineEntry, RecheckFor, Rechecked, Reply};
use super::record::{Proof, Proofs, Removal, Why};

impl Core {
    /// One entry per quarantined slot (a k-slot lease has k), by lease id.
    pub(super) fn quarantine_entries(&self) -> Vec<QuarantineEntry> {
        self.entries_of(&self.book.keys_where(|r| r.is_quarantined()))
    }

    fn entries_of(&self, keys: &[LeaseKey]) -> Vec<QuarantineEntry> {
        let mut entries: Vec<QuarantineEntry> = keys
            .iter()
            .filter_map(|key| self.book.get(*key).map(|r| (*key, r)))
            .flat_map(|(key, r)| {
                let reason = r.reason_line();
                r.tokens().map(move |token| QuarantineEntry {
                    key,
                    token,
                    reason: reason.clone(),
                })
            })
            .collect();
        entries.sort_by_key(|e| (e.token.lease_id(), e.token.slot_id()));
        entries
    }

    pub(super) fn list_quarantine(&mut self, control: ControlId) {
        let entries = self.quarantine_entries();
        self.fx.push(Effect::Reply {
            control,
            reply: Reply::Quarantine(entries),
        });
    }

    /// Asks for a re-check of every unproven process group of the quarantined leases. The
    /// shell answers with [`Rechecked`](super::Input::Rechecked), all at once.
    pub(super) fn recheck(&mut self, purpose: RecheckFor) {
        let leases = self.book.keys_where(|r| r.is_quarantined());
        let checks = leases
            .iter()
            .filter_map(|key| self.book.get(*key).map(|r| (*key, r)))
            .flat_map(|(key, r)| {
                r.reasons
                    .iter()
                    // A temp dir is retried once the re-checks are in (`rechecked`).
                    .filter(|x| x.why == Why::Unproven && matches!(x.proof, Proof::Process(_)))
                    .map(move |x| (key, x.proof))
            })
            .collect();
        self.rechecks += 1;
        self.fx.push(Effect::Recheck {
            checks,
            leases: leases.into(),
            purpose,
        });
    }

    pub(super) fn rechecked(
        &mut self,
        results: Box<[Rechecked]>,
        leases: Box<[LeaseKey]>,
        purpose: RecheckFor,
    ) {
        let Some(left) = self.rechecks.checked_sub(1) else {
            return self
                .fx
                .illegal(format_args!("re-checks that were not asked for"));
        };
        self.rechecks = left;
        // A reclaim's leases, with their tokens, as they are before the results apply: a lease
        // its re-check frees may end in this very step (the pool takes its slots back at once),
        // and is then reclaimed, not forgotten.
        let reclaiming: Option<Vec<(LeaseKey, Vec<crate::broker::SlotToken>)>> =
            matches!(purpose, RecheckFor::Reclaim(_)).then(|| {
                leases
                    .iter()
                    .filter_map(|key| self.book.get(*key).map(|r| (*key, r.tokens().collect())))
                    .collect()
            });
        for Rechecked {
            key,
            proof,
            outcome,
        } in results
        {
            let Proof::Process(process) = proof else {
                self.fx
                    .illegal(format_args!("re-check of {proof:?} for lease {key}"));
                continue;
            };
            let owed = self
                .book
                .get(key)
                .is_some_and(|r| r.owed.owes(proof) && !r.is_releasing());
            if !owed {
                // Proven meanwhile, or released: nothing to learn.
                continue;
            }
            match outcome {
                Ok(()) => self.proven(key, Proofs::default(), Some(process)),
                Err(detail) => self.missing(key, proof, Why::Unproven, detail, None),
            }
        }
        for key in &leases {
            let retry = self.book.edit(*key, |r| {
                let retry = r.removal == Removal::Failed && r.owed.physically_done();
                if retry {
                    // The slot is clean but for its temp dir: try its removal again.
                    r.removal = Removal::NotStarted;
                    r.reasons.retain(|x| x.proof != Proof::TempDir);
                }
                retry
            });
            if retry == Some(true) {
                self.advance(*key);
            }
        }
        let (RecheckFor::Reclaim(control), Some(leases)) = (purpose, reclaiming) else {
            return;
        };
        // A temp dir being removed is part of the re-check: the reply waits for every removal
        // in flight (one retried just above included) that is not already reported late.
        self.reclaims.push(PendingReclaim { control, leases });
        self.answer_reclaims();
    }

    /// Answers every reclaim whose re-checks have all ended, and whose leases have no temp dir
    /// removal in flight that is not already reported late: a slot is `reclaimed` only once
    /// each of its re-checks succeeded (its record is gone, or has no reason left); any other is
    /// still quarantined, with its reason. Called after every input while one waits.
    pub(super) fn answer_reclaims(&mut self) {
        let mut i = 0;
        while i < self.reclaims.len() {
            let removing = self.reclaims[i].leases.iter().any(|(key, _)| {
                self.book.get(*key).is_some_and(|r| {
                    r.removal == Removal::Running
                        && !r.reasons.iter().any(|x| x.proof == Proof::TempDir)
                })
            });
            if removing {
                i += 1;
                continue;
            }
            let PendingReclaim { control, leases } = self.reclaims.swap_remove(i);
            let mut reclaimed = Vec::new();
            let mut still = Vec::new();
            for (key, tokens) in leases {
                match self.book.get(key) {
                    Some(r) if !r.reasons.is_empty() => still.push(key),
                    _ => reclaimed.extend(tokens),
                }
            }
            let still = self.entries_of(&still);
            self.fx.push(Effect::Reply {
                control,
                reply: Reply::Reclaimed {
                    reclaimed: reclaimed.into(),
                    still: still.into(),
                },
            });
        }
    }
}

/// A reclaim whose re-checks are not all in: the temp dirs it retries are being removed.
#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(super) struct PendingReclaim {
    control: ControlId,
    /// Every lease quarantined when it was asked, with its tokens.
    leases: Vec<(LeaseKey, Vec<crate::broker::SlotToken>)>,
}
