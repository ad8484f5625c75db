//! Configuring and starting a supervisor.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ractor::Actor;

use super::actor::{BrokerPort, Config, SupArgs, SupervisorActor};
use super::core::CoreConfig;
use super::handle::Supervisor;
use super::inbox::Inbox;
use super::messages::SupMsg;
use super::reports::LastReport;
use super::state::Parts;
use super::stats::SharedStats;
use super::table::LeaseTable;
use crate::broker::{BrokerEvents, DynBroker, LocalBroker, Pool, SlotBroker};
use crate::error::StartError;
use crate::hosts::Hosts;
use crate::process::ProcessPolicy;
use crate::sink::{ErrorSink, OrphanedFailure};

/// Default bound for each release.
const DEFAULT_CLEANUP_TIMEOUT: Duration = Duration::from_secs(5);
/// Default time a cancelled body may keep running before its future is dropped.
const DEFAULT_CANCEL_GRACE: Duration = Duration::from_secs(5);
/// Default time between `SIGTERM` and `SIGKILL` for a job's process group.
const DEFAULT_PROCESS_GRACE: Duration = Duration::from_secs(5);
/// Default bound for proving a job's process group empty.
const DEFAULT_PROCESS_PROOF_BOUND: Duration = Duration::from_secs(2);
/// Default bound for a shutdown's wait for the jobs it cancelled.
const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

enum Source {
    None,
    Slots(u32),
    /// A `LocalBroker` given through `.broker(..)`: still the supervisor's own pool.
    Local(LocalBroker),
    Broker(Arc<dyn DynBroker>),
}

/// Builds a [`Supervisor`]. Start with [`Supervisor::builder`].
#[must_use = "a builder does nothing until .start().await"]
pub struct SupervisorBuilder {
    source: Source,
    cleanup_timeout: Duration,
    acquire_timeout: Option<Duration>,
    cancel_grace: Duration,
    drain_timeout: Option<Duration>,
    work_root: Option<PathBuf>,
    error_sink: Option<ErrorSink>,
    process_grace: Duration,
    process_proof_bound: Duration,
    child_subreaper: bool,
    shutdown_timeout: Duration,
    held_warning: Option<Duration>,
    #[cfg(feature = "gpu")]
    gpu: Option<crate::gpu::GpuOptions>,
    /// Fakes in place of the file system, processes and GPU (the simulation test).
    #[cfg(test)]
    hosts: Option<Hosts>,
}

impl Supervisor {
    /// Starts configuring a supervisor.
    pub fn builder() -> SupervisorBuilder {
        SupervisorBuilder::new()
    }
}

impl SupervisorBuilder {
    pub(crate) fn new() -> Self {
        Self {
            source: Source::None,
            cleanup_timeout: DEFAULT_CLEANUP_TIMEOUT,
            acquire_timeout: None,
            cancel_grace: DEFAULT_CANCEL_GRACE,
            drain_timeout: None,
            work_root: None,
            error_sink: None,
            process_grace: DEFAULT_PROCESS_GRACE,
            process_proof_bound: DEFAULT_PROCESS_PROOF_BOUND,
            child_subreaper: true,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            held_warning: None,
            #[cfg(feature = "gpu")]
            gpu: None,
            #[cfg(test)]
            hosts: None,
        }
    }

    /// Uses the in-process [`LocalBroker`] with `n` slots (replaces any `.broker(..)`).
    pub fn slots(mut self, n: u32) -> Self {
        self.source = Source::Slots(n);
        self
    }

    /// Uses any [`SlotBroker`] (replaces any `.slots(..)`); the broker alone decides capacity.
    /// A [`LocalBroker`] given here is the supervisor's own pool, exactly as with
    /// [`slots`](Self::slots): multi-slot leases, `try_acquire` and `resize` work on it.
    pub fn broker<B: SlotBroker>(mut self, broker: B) -> Self {
        let mut slot = Some(broker);
        self.source =
            match (&mut slot as &mut dyn std::any::Any).downcast_mut::<Option<LocalBroker>>() {
                Some(local) => Source::Local(local.take().expect("just set")),
                None => Source::Broker(Arc::new(slot.take().expect("just set"))),
            };
        self
    }

    /// Warns once about each lease held at least this long (default: never): a `tracing`
    /// warning naming the job, its slot and what its release still waits for, and one count of
    /// `render_slot.held_too_long.count`. Checked a few times per threshold (every quarter of
    /// it), so a warning comes at most a quarter of the threshold late.
    pub fn held_warning(mut self, threshold: Duration) -> Self {
        self.held_warning = Some(threshold);
        self
    }

    /// Bound for each broker release (default 5 s). The caller's cancellation cannot shorten it.
    pub fn cleanup_timeout(mut self, timeout: Duration) -> Self {
        self.cleanup_timeout = timeout;
        self
    }

    /// How long a caller waits for a slot before `LEASE_ACQUIRE_TIMEOUT` (default: no bound,
    /// FIFO).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = Some(timeout);
        self
    }

    /// How long a cancelled body may keep running before the worker drops its future (default
    /// 5 s). Tracked tasks and blocking closures are awaited regardless: they cannot be dropped.
    pub fn cancel_grace(mut self, grace: Duration) -> Self {
        self.cancel_grace = grace;
        self
    }

    /// How long tracked tasks may outlive the worker before the slot is quarantined and the
    /// caller hears `LEASE_CLEANUP_UNCONFIRMED` (default: no bound, the slot waits). A
    /// quarantined slot is released as soon as its tasks end and its temp dir is removed.
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = Some(timeout);
        self
    }

    /// The directory under which each job gets its own temp dir (created if missing). Default:
    /// a fresh directory under the OS temp dir, owned by the supervisor and removed when it stops.
    pub fn work_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.work_root = Some(root.into());
        self
    }

    /// Where cleanup failures go when no caller is left to hear them (a dropped lease, a dropped
    /// `run` future). Never called in the supervisor's turn: failures wait in a bounded queue
    /// (1024) and the sink is called on tokio's blocking pool, one failure at a time, in order.
    /// A sink that blocks or falls behind delays no caller; the failures its queue has no room
    /// for are counted in `render_slot.sink.dropped.count` and logged. A panic in it is caught
    /// and logged, and it is called again for the next failure.
    pub fn error_sink(mut self, sink: impl Fn(&OrphanedFailure) + Send + Sync + 'static) -> Self {
        self.error_sink = Some(Arc::new(sink));
        self
    }

    /// Time between `SIGTERM` and `SIGKILL` when a job's process group is stopped (default 5 s).
    pub fn process_grace(mut self, grace: Duration) -> Self {
        self.process_grace = grace;
        self
    }

    /// How long a job's process group may take to be proven empty once its leader has been
    /// reaped (after `SIGKILL`, when it was stopped) before the slot is quarantined (default 2 s).
    pub fn process_proof_bound(mut self, bound: Duration) -> Self {
        self.process_proof_bound = bound;
        self
    }

    /// Whether this process becomes a child subreaper (Linux `PR_SET_CHILD_SUBREAPER`) when a job
    /// first spawns a process (default `true`). As a subreaper it inherits descendants orphaned by
    /// their parents, so it can reap them and see those that left their job's process group; a
    /// job ends `LEASE_CLEANUP_UNCONFIRMED` while such an orphan is alive. The setting is
    /// process-wide and cannot be undone; any other child of this process in a process group of
    /// its own (neither this process's group nor a job's) is then also taken for an escaped
    /// descendant. Turn it off when that matters more than reaping escapees; descendants that
    /// escape a job's group are then seen only while their parent is alive.
    pub fn child_subreaper(mut self, enabled: bool) -> Self {
        self.child_subreaper = enabled;
        self
    }

    /// How long `shutdown` waits for what it cancelled (default 30 s): running bodies, tracked
    /// tasks (aborted once the cancel grace has passed), process groups (stopped with `SIGTERM`,
    /// then `SIGKILL` after the process grace), GPU work and temp dir removals. Whatever is not
    /// proven done by then is quarantined and listed in
    /// [`ShutdownReport::unproven`](crate::ShutdownReport::unproven); shutdown then returns,
    /// leaving behind only what cannot be stopped (a blocking closure still running, a
    /// process in uninterruptible sleep), reported, never waited for without end. Broker
    /// releases and the GPU devices' close add at most the cleanup timeout each.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// Scripted hosts in place of the real ones (the simulation test).
    #[cfg(test)]
    pub(crate) fn hosts(mut self, hosts: Hosts) -> Self {
        self.hosts = Some(hosts);
        self
    }

    /// Owns GPU devices (feature `gpu`): they are opened at start, shared with jobs through
    /// [`WorkerContext::gpu`](crate::WorkerContext::gpu), and a slot returns only after the GPU
    /// work submitted under it has completed. Without `.slots(n)` or `.broker(b)`, the pool's
    /// sub-slots (devices × slots per device) are the slots; with them, at most that many
    /// leases are held at once.
    #[cfg(feature = "gpu")]
    pub fn gpu(mut self, options: crate::gpu::GpuOptions) -> Self {
        self.gpu = Some(options);
        self
    }

    /// Validates the configuration and spawns the supervisor actor on the current tokio runtime.
    ///
    /// # Errors
    ///
    /// [`StartError`] (code `SUPERVISOR_START_FAILED`): no slots configured, zero capacity, a
    /// zero cleanup timeout, an unusable work root, or no tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: dropping the future after the actor has spawned leaves a supervisor with
    /// no handle, which stops at once (nothing can have been acquired through it).
    pub async fn start(self) -> Result<Supervisor, StartError> {
        #[cfg(test)]
        #[cfg_attr(not(feature = "gpu"), allow(unused_mut))]
        let mut hosts = self.hosts.unwrap_or_else(Hosts::os);
        #[cfg(not(test))]
        #[cfg_attr(not(feature = "gpu"), allow(unused_mut))]
        let mut hosts = Hosts::os();
        #[cfg(feature = "gpu")]
        let gpu = match self.gpu {
            Some(opts) => Some(Arc::new(
                crate::gpu::GpuPool::open(opts)
                    .await
                    .map_err(StartError::Gpu)?,
            )),
            None => None,
        };
        #[cfg(feature = "gpu")]
        if let Some(pool) = &gpu {
            hosts.gpu = Some(Arc::new(crate::hosts::PoolHost(Arc::clone(pool))));
        }
        #[cfg(feature = "gpu")]
        let gpu_capacity = hosts.gpu.as_ref().map(|g| g.capacity());
        #[cfg(not(feature = "gpu"))]
        let gpu_capacity: Option<u32> = None;
        let source = match (self.source, gpu_capacity) {
            (Source::None, Some(n)) => Source::Slots(n),
            (source, _) => source,
        };
        // The in-process pool goes to the core, which owns it from here on.
        let (broker, pool) = match source {
            Source::None => return Err(StartError::NoBroker),
            Source::Slots(0) => return Err(StartError::ZeroCapacity),
            Source::Slots(n) => (BrokerPort::Pool, Some(Pool::new(n))),
            Source::Local(pool) if pool.slots() == 0 => return Err(StartError::ZeroCapacity),
            Source::Local(pool) => (BrokerPort::Pool, Some(pool.into_pool())),
            Source::Broker(b) if b.capacity() == Some(0) => return Err(StartError::ZeroCapacity),
            Source::Broker(b) => (BrokerPort::Dyn(b), None),
        };
        let broker_capacity = match &broker {
            BrokerPort::Pool => pool.as_ref().map(Pool::slots),
            BrokerPort::Dyn(b) => b.capacity(),
        };
        for (name, d) in [
            ("cleanup_timeout", self.cleanup_timeout),
            ("shutdown_timeout", self.shutdown_timeout),
        ] {
            if d.is_zero() {
                return Err(StartError::ZeroDuration(name));
            }
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(StartError::Spawn("no tokio runtime".into()));
        }
        let (work_root, owned_root) = match self.work_root {
            Some(path) => (prepare_root(path)?, None),
            None => {
                let dir = tempfile::Builder::new()
                    .prefix("leasehold-")
                    .tempdir()
                    .map_err(|source| StartError::WorkRoot {
                        path: std::env::temp_dir(),
                        source,
                    })?;
                (dir.path().to_path_buf(), Some(dir))
            }
        };
        // The user's error sink runs off the supervisor's turn, fed by a bounded queue.
        let sink =
            crate::sink::Sink::new(self.error_sink.clone(), tokio::runtime::Handle::current());
        let config = Arc::new(Config {
            cleanup_timeout: self.cleanup_timeout,
            cancel_grace: self.cancel_grace,
            drain_timeout: self.drain_timeout,
            shutdown_timeout: self.shutdown_timeout,
            work_root: Arc::new(work_root.clone()),
            sink: sink.clone(),
            hosts,
            held_warning: self.held_warning,
            acquire_timeout: self.acquire_timeout,
            process_policy: ProcessPolicy {
                grace: self.process_grace,
                proof_bound: self.process_proof_bound,
                subreaper: self.child_subreaper,
            },
        });
        // Only the in-process pool can change its size (`Supervisor::resize`).
        let resizable = pool.is_some();
        let stats = Arc::new(SharedStats::default());
        stats.set_capacity(super::core::capacity(broker_capacity, gpu_capacity));
        let (renews, attach_to) = match &broker {
            BrokerPort::Pool => (false, None),
            BrokerPort::Dyn(b) => (b.renews(), Some(Arc::clone(b))),
        };
        let core = CoreConfig {
            broker_capacity,
            pool,
            gpu_slots: gpu_capacity,
            renews,
        };
        let table = Arc::new(LeaseTable::default());
        let origin = {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::hash::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.finish().max(1)
        };
        let inbox = Arc::new(Inbox::new());
        let last_report = Arc::new(LastReport::default());
        let args = SupArgs {
            origin,
            core,
            broker,
            config,
            stats: Arc::clone(&stats),
            last_report: Arc::clone(&last_report),
            inbox: Arc::clone(&inbox),
            table: Arc::clone(&table),
            owned_root,
        };
        let (actor, join) = Actor::spawn(None, SupervisorActor, args)
            .await
            .map_err(|e| StartError::Spawn(e.to_string()))?;
        inbox.bind(actor.clone());
        // Before `start` returns, so before any acquire.
        // The pool sends no events: only a broker of the user's is attached.
        if let Some(broker) = attach_to {
            let events_to = Arc::clone(&inbox);
            let events = BrokerEvents::new(move |event| {
                let _ = events_to.send(SupMsg::Broker(event));
            })
            .with_origin(origin);
            // The broker's code: a panic stops the supervisor just spawned (nobody holds it
            // yet), which drops the broker off its turn, and `start` says why.
            if let Err(panic) = crate::outside::call(|| broker.attach(events)) {
                drop(broker);
                actor.stop(Some("the broker's attach panicked".to_owned()));
                let _ = join.await;
                return Err(StartError::BrokerAttach(panic));
            }
        }
        Ok(Supervisor::from_parts(Parts {
            inbox,
            join,
            stats,
            table,
            last_report,
            acquire_timeout: self.acquire_timeout,
            cancel_grace: self.cancel_grace,
            shutdown_timeout: self.shutdown_timeout,
            resizable,
            work_root,
            sink,
            #[cfg(feature = "gpu")]
            gpu,
        }))
    }
}

/// Creates the root if needed, proves it writable, and makes it absolute.
fn prepare_root(path: PathBuf) -> Result<PathBuf, StartError> {
    let fail = |source| StartError::WorkRoot {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(&path).map_err(fail)?;
    let root = std::fs::canonicalize(&path).map_err(fail)?;
    tempfile::Builder::new()
        .prefix(".leasehold-probe-")
        .tempdir_in(&root)
        .map_err(fail)?;
    Ok(root)
}

impl fmt::Debug for SupervisorBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match &self.source {
            Source::None => "none".to_owned(),
            Source::Slots(n) => format!("LocalBroker({n})"),
            Source::Local(pool) => format!("{pool:?}"),
            Source::Broker(_) => "custom broker".to_owned(),
        };
        f.debug_struct("SupervisorBuilder")
            .field("source", &source)
            .field("cleanup_timeout", &self.cleanup_timeout)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("cancel_grace", &self.cancel_grace)
            .field("drain_timeout", &self.drain_timeout)
            .field("work_root", &self.work_root)
            .field("error_sink", &self.error_sink.is_some())
            .field("process_grace", &self.process_grace)
            .field("process_proof_bound", &self.process_proof_bound)
            .field("child_subreaper", &self.child_subreaper)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("held_warning", &self.held_warning)
            .finish()
    }
}
