//! Renewal and loss: the broker's session lease, kept alive on one stream; what a held token's
//! [`keep_alive`](leasehold::SlotBroker::keep_alive) reports; and the per-token rule that keeps
//! "renewal only while the supervisor holds the lease" true under a shared session.
//!
//! One etcd lease per broker (its session) carries every key the broker writes: queue places,
//! request markers, slot keys. A background keeper renews it every third of the TTL on one
//! keep-alive stream (moving to another member when that one fails) and never gives up on its
//! own: only etcd saying the lease is gone (`Expired`) ends a session. A process that dies stops
//! renewing, and etcd deletes its keys one TTL later.
//!
//! Because the session outlives any one token, a token carries its own claim: the supervisor's
//! `keep_alive` future holds it. A token nobody keeps alive for one TTL — never claimed (a grant
//! that reached nobody: the supervisor had stopped), or no longer claimed and not released — is
//! given back by the broker itself, as etcd would have let a per-token lease lapse.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use tokio::sync::{Notify, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::CancellationToken;

use super::endpoints::Endpoints;
use super::error::{EtcdError, EtcdErrorKind, Fail};
use super::records::{Claim, Liveness, Session};
use crate::inner::Inner;
use leasehold::SlotToken;

impl Inner {
    /// The live session, granted now if there is none (or the last one expired).
    pub(super) async fn session(&self, deadline: Instant) -> Result<Arc<Session>, EtcdError> {
        if self.closed.is_cancelled() {
            return Err(self.closed_error());
        }
        if let Some(s) = self.session.lock().clone()
            && !s.is_expired()
        {
            return Ok(s);
        }
        let _one_grant_at_a_time = self.granting.lock().await;
        if self.closed.is_cancelled() {
            return Err(self.closed_error());
        }
        if let Some(s) = self.session.lock().clone()
            && !s.is_expired()
        {
            return Ok(s);
        }
        let ttl = self.ttl.as_secs() as i64;
        let asked_at = Instant::now();
        // etcd picks the id: a grant whose answer was lost is granted again, and the lost one
        // (with no key under it) simply expires.
        let granted = self
            .endpoints
            .call("grant the session lease", deadline, |mut c| async move {
                c.lease_grant(ttl, None).await
            })
            .await
            .map_err(|f| match f {
                Fail::NotFound => EtcdError::new(
                    EtcdErrorKind::InvalidResponse,
                    "lease grant answered \"lease not found\"",
                ),
                other => other.into_etcd("grant the session lease"),
            })?;
        if granted.ttl() <= 0 || granted.id() == 0 {
            return Err(EtcdError::new(
                EtcdErrorKind::InvalidResponse,
                format!(
                    "lease grant answered id {} with ttl {}",
                    granted.id(),
                    granted.ttl()
                ),
            ));
        }
        let (tx, rx) = watch::channel(Liveness::Alive { renewed: asked_at });
        let renew_now = Arc::new(Notify::new());
        let session = Arc::new(Session {
            id: granted.id(),
            live: rx,
            renew_now: Arc::clone(&renew_now),
        });
        tokio::spawn(
            Keeper {
                endpoints: Arc::clone(&self.endpoints),
                id: granted.id(),
                ttl: self.ttl,
                rpc_timeout: self.rpc_timeout,
                tx,
                renew_now,
                closing: self.closing.clone(),
                revoked: Arc::clone(&self.revoked),
            }
            .run(asked_at),
        );
        tracing::debug!(
            session = format_args!("{:016x}", session.id),
            "etcd session granted"
        );
        *self.session.lock() = Some(Arc::clone(&session));
        Ok(session)
    }

    /// What an acquire of a closed broker answers.
    pub(super) fn closed_error(&self) -> EtcdError {
        EtcdError::new(
            EtcdErrorKind::Closed,
            format!(
                "the broker of pool {:?} is closed: it grants nothing more",
                self.layout.prefix()
            ),
        )
    }

    /// How long before a session could lapse its holders are told their lease is lost.
    pub(super) fn margin(&self) -> Duration {
        (self.ttl / 4).min(Duration::from_secs(2))
    }

    /// Resolves when the lease behind `token` is lost or may lapse before it can be renewed
    /// (see [`SlotBroker::keep_alive`](leasehold::SlotBroker::keep_alive)), and marks the token
    /// lost: the broker has told its holder, so its release answers at once (see `release`).
    /// Holds the token's claim while it runs.
    pub(super) async fn keep_alive(self: &Arc<Self>, token: SlotToken) -> EtcdError {
        let lost = self.watch_lease(token).await;
        if lost.kind() == EtcdErrorKind::LeaseLost
            && let Some(entry) = self.held.lock().get_mut(&token)
        {
            entry.lost = true;
        }
        lost
    }

    async fn watch_lease(self: &Arc<Self>, token: SlotToken) -> EtcdError {
        let session = {
            let mut held = self.held.lock();
            let Some(entry) = held.get_mut(&token) else {
                return EtcdError::new(
                    EtcdErrorKind::NotOurs,
                    format!("{token} was not granted by this broker, or was already released"),
                );
            };
            entry.claim = match entry.claim {
                Claim::Unclaimed { .. } => Claim::KeptAlive(1),
                Claim::KeptAlive(n) => Claim::KeptAlive(n + 1),
                Claim::Expired => {
                    return EtcdError::new(
                        EtcdErrorKind::LeaseLost,
                        format!("{token} was given back after a ttl without renewal"),
                    );
                }
            };
            Arc::clone(&entry.session)
        };
        let _claim = ClaimGuard {
            inner: Arc::downgrade(self),
            token,
        };
        let mut live = session.live.clone();
        loop {
            let now = Instant::now();
            let lapse_at = match *live.borrow_and_update() {
                Liveness::Expired => {
                    return EtcdError::new(
                        EtcdErrorKind::LeaseLost,
                        format!(
                            "{token}: the broker's etcd session {:016x} expired",
                            session.id
                        ),
                    );
                }
                Liveness::Alive { renewed } => {
                    let lapse_at = renewed + self.ttl - self.margin();
                    if now >= lapse_at {
                        return EtcdError::new(
                            EtcdErrorKind::LeaseLost,
                            format!(
                                "{token}: the broker's etcd session {:016x} could not be renewed for {:?}; it may lapse (ttl {:?})",
                                session.id,
                                now - renewed,
                                self.ttl
                            ),
                        );
                    }
                    lapse_at
                }
            };
            tokio::select! {
                changed = live.changed() => {
                    if changed.is_err() {
                        return EtcdError::new(
                            EtcdErrorKind::LeaseLost,
                            format!("{token}: the broker closed, its session is no longer renewed"),
                        );
                    }
                }
                () = sleep_until(lapse_at) => {}
            }
        }
    }

    /// Starts the one-TTL clock of a token nobody keeps alive since `since` (stopped by
    /// `close`, whose revoke frees the slot anyway).
    pub(super) fn watch_unclaimed(self: &Arc<Self>, token: SlotToken, since: Instant) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = Arc::downgrade(self);
        let (ttl, closed) = (self.ttl, self.closed.clone());
        rt.spawn(async move {
            tokio::select! {
                () = sleep_until(since + ttl) => {}
                () = closed.cancelled() => return,
            }
            if let Some(inner) = inner.upgrade() {
                inner.expire_unclaimed(token, since).await;
            }
        });
    }

    /// Gives back a token that has not been kept alive for one TTL since `since` (unless it was
    /// claimed or released meanwhile).
    async fn expire_unclaimed(self: &Arc<Self>, token: SlotToken, since: Instant) {
        // The request is marked settling under the lock that takes the token away (`held`,
        // then `settling_requests`, as in `release`): an acquire of it finds the token or the
        // mark, never neither.
        let (entry, _request) = {
            let mut held = self.held.lock();
            match held.get_mut(&token) {
                Some(entry) if entry.claim == (Claim::Unclaimed { since, ever: true }) => {
                    // The supervisor may still hold it (its job winding down after a loss):
                    // the slot goes back to the pool, the index stays off limits here.
                    entry.claim = Claim::Expired;
                    let entry = entry.clone();
                    let request = SettlingRequest::new(self, entry.rk);
                    (entry, request)
                }
                Some(entry) if entry.claim == (Claim::Unclaimed { since, ever: false }) => {
                    // Never claimed: the grant reached nobody (the supervisor had stopped).
                    let entry = entry.clone();
                    let request = SettlingRequest::new(self, entry.rk);
                    held.remove(&token);
                    let mut forgotten = self.forgotten.lock();
                    if forgotten.len() >= 1024 {
                        forgotten.pop_front();
                    }
                    forgotten.push_back(token);
                    (entry, request)
                }
                _ => return,
            }
        };
        let _settling = Settling::new(self);
        self.releases
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.released.notify_waiters();
        tracing::warn!(
            %token,
            claimed_before = matches!(entry.claim, Claim::Expired),
            "etcd slot not kept alive for a ttl: the broker gives it back"
        );
        self.settle(token, entry, false).await;
    }
}

/// Ends a keep-alive's claim on its token when the future is dropped (or resolves).
struct ClaimGuard {
    inner: Weak<Inner>,
    token: SlotToken,
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        let Some(inner) = self.inner.upgrade() else {
            return;
        };
        let unclaimed_since = {
            let mut held = inner.held.lock();
            let Some(entry) = held.get_mut(&self.token) else {
                return;
            };
            match entry.claim {
                Claim::KeptAlive(n) if n > 1 => {
                    entry.claim = Claim::KeptAlive(n - 1);
                    None
                }
                Claim::KeptAlive(_) => {
                    let since = Instant::now();
                    entry.claim = Claim::Unclaimed { since, ever: true };
                    Some(since)
                }
                _ => None,
            }
        };
        if let Some(since) = unclaimed_since {
            inner.watch_unclaimed(self.token, since);
        }
    }
}

/// Renews session `id` every third of `ttl` (or at once when asked) until etcd says it is gone
/// or the broker closes (then it revokes it). Publishes every successful renewal and the
/// expiry.
struct Keeper {
    endpoints: Arc<Endpoints>,
    id: i64,
    ttl: Duration,
    rpc_timeout: Duration,
    tx: watch::Sender<Liveness>,
    renew_now: Arc<Notify>,
    closing: CancellationToken,
    /// Set by `close` once it has revoked the session itself.
    revoked: Arc<AtomicBool>,
}

impl Keeper {
    async fn run(self, granted_at: Instant) {
        let Keeper {
            endpoints,
            id,
            ttl,
            rpc_timeout,
            tx,
            renew_now,
            closing,
            revoked,
        } = self;
        let every = ttl / 3;
        let mut renewed = granted_at;
        let mut stream: Option<(usize, LeaseKeeper, LeaseKeepAliveStream)> = None;
        let lease = format!("{id:016x}");
        loop {
            tokio::select! {
                () = closing.cancelled() => {
                    if revoked.load(Ordering::Acquire) {
                        return; // `close` revoked it, and waited for the answer
                    }
                    // The broker was dropped without `close`: whatever is left under its
                    // session goes now, not one TTL later, if this task gets to run (nothing
                    // waits for it). One attempt; the TTL covers a failure.
                    let _ = endpoints
                        .call("revoke the session", Instant::now() + rpc_timeout, |mut c| async move {
                            c.lease_revoke(id).await
                        })
                        .await;
                    return;
                }
                () = sleep_until(renewed + every) => {}
                () = renew_now.notified() => {}
            }
            let mut backoff = Duration::from_millis(50);
            loop {
                if closing.is_cancelled() {
                    break;
                }
                let sent_at = Instant::now();
                let outcome = match &mut stream {
                    Some((member, keeper, responses)) => {
                        let answered = async {
                            keeper.keep_alive().await?;
                            responses.message().await
                        };
                        match timeout(rpc_timeout, answered).await {
                            Ok(Ok(Some(resp))) if resp.ttl() > 0 => Ok(()),
                            Ok(Ok(Some(_))) => Err(Fail::NotFound),
                            Ok(Ok(None)) => Err(Fail::Ambiguous("keep-alive stream closed".into())),
                            Ok(Err(err)) => Err(super::error::classify(err)),
                            Err(_) => Err(Fail::Ambiguous(format!(
                                "no keep-alive answer within {rpc_timeout:?}"
                            ))),
                        }
                        .inspect_err(|f| {
                            if let Fail::Ambiguous(why) = f {
                                endpoints.mark_down(*member, why);
                            }
                        })
                    }
                    None => {
                        // Opening the stream sends the first renewal and reads its answer.
                        match endpoints
                            .call_on(
                                "keep the session alive",
                                sent_at + rpc_timeout,
                                |mut c| async move { c.lease_keep_alive(id).await },
                            )
                            .await
                        {
                            Ok((member, (keeper, responses))) => {
                                stream = Some((member, keeper, responses));
                                Ok(())
                            }
                            Err(fail) => Err(fail),
                        }
                    }
                };
                match outcome {
                    Ok(()) => {
                        renewed = sent_at;
                        tx.send_replace(Liveness::Alive { renewed });
                        break;
                    }
                    Err(Fail::NotFound) => {
                        tracing::warn!(session = %lease, "etcd session expired");
                        tx.send_replace(Liveness::Expired);
                        return;
                    }
                    Err(Fail::Fatal(e)) => {
                        tracing::warn!(session = %lease, error = %e, "etcd session renewal refused; retrying");
                        stream = None;
                    }
                    Err(Fail::Ambiguous(why)) => {
                        tracing::debug!(session = %lease, error = %why, "etcd session renewal retried");
                        stream = None;
                    }
                }
                tokio::select! {
                    () = closing.cancelled() => {}
                    () = sleep(backoff) => {}
                    () = renew_now.notified() => {}
                }
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }
}

/// Counts a give-back in progress in the background (see `EtcdBroker::settling`) while it
/// lives.
pub(super) struct Settling(Arc<Inner>);

impl Settling {
    pub(super) fn new(inner: &Arc<Inner>) -> Self {
        inner.settling.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(inner))
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        self.0.settling.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Marks request `rk` as having a release settling while it lives (see
/// [`Inner::settles`]): a release in the foreground (taken before its token leaves `held`), a
/// release settled in the background, and a token given back after a ttl nobody kept it alive.
pub(super) struct SettlingRequest {
    inner: Arc<Inner>,
    rk: u64,
}

impl SettlingRequest {
    pub(super) fn new(inner: &Arc<Inner>, rk: u64) -> Self {
        *inner.settling_requests.lock().entry(rk).or_default() += 1;
        Self {
            inner: Arc::clone(inner),
            rk,
        }
    }
}

impl Drop for SettlingRequest {
    fn drop(&mut self) {
        let mut requests = self.inner.settling_requests.lock();
        if let Some(n) = requests.get_mut(&self.rk) {
            *n -= 1;
            if *n == 0 {
                requests.remove(&self.rk);
            }
        }
    }
}
