//! Metrics and traces: the `render_slot.*` names of DESIGN.md section 5 with plausible values,
//! the `leasehold.job` span with its ids and its parent, and the error event for a cleanup
//! failure nobody hears.
//!
//! Each test installs its recorder or subscriber for its own thread only, and runs everything
//! on a current-thread runtime on that thread (the supervisor's and workers' tasks included), so
//! tests in this file cannot see each other's metrics or spans.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{Plan, TestBroker, until};
use leasehold::{JobSpec, OrphanedFailure, Supervisor, metric_names};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Instrument, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------------

/// Counters and histograms summed over snapshots (a snapshot drains them); gauges keep their
/// last value.
#[derive(Debug, Default)]
struct Seen {
    counters: HashMap<String, u64>,
    gauges: HashMap<String, f64>,
    histograms: HashMap<String, Vec<f64>>,
}

impl Seen {
    /// Takes a snapshot, returning the gauges it saw, and adds its counters and histograms.
    fn take(&mut self, snapshotter: &Snapshotter) -> HashMap<String, f64> {
        let mut gauges = HashMap::new();
        for (key, _unit, _desc, value) in snapshotter.snapshot().into_vec() {
            let name = key.key().name().to_owned();
            assert_eq!(key.key().labels().count(), 0, "{name} has labels: {key:?}");
            match value {
                DebugValue::Counter(n) => *self.counters.entry(name).or_default() += n,
                DebugValue::Gauge(v) => {
                    gauges.insert(name.clone(), v.into_inner());
                    self.gauges.insert(name, v.into_inner());
                }
                DebugValue::Histogram(vs) => self
                    .histograms
                    .entry(name)
                    .or_default()
                    .extend(vs.into_iter().map(|v| v.into_inner())),
            }
        }
        gauges
    }
}

/// On the in-process pool, which the supervisor's core frees in the step that ends a lease
/// (no broker call), each release is still counted and timed (at 0 ms), and is already in the
/// metrics when the awaited `release` returns, as in `Stats`.
#[test]
fn the_pools_releases_are_counted_and_timed_and_visible_when_release_returns() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = current_thread_runtime();
    let mut seen = Seen::default();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let sup = Supervisor::builder().slots(2).start().await.unwrap();
            for round in 1..=3u64 {
                let mut two = sup.acquire_many(2).await.unwrap();
                two.release().await.unwrap();
                seen.take(&snapshotter);
                let stats = sup.stats();
                assert_eq!(stats.released_total, 2 * round);
                assert_eq!(
                    seen.counters.get(metric_names::RELEASE_COUNT),
                    Some(&(2 * round)),
                    "after round {round}: {seen:?}"
                );
                let times = &seen.histograms[metric_names::RELEASE_DURATION_MS];
                assert_eq!(times.len() as u64, 2 * round, "{times:?}");
                assert!(times.iter().all(|t| *t == 0.0), "{times:?}");
            }
            let failed = seen.counters.get(metric_names::RELEASE_FAILED_COUNT);
            assert_eq!(failed.copied().unwrap_or(0), 0);
            sup.shutdown().await.unwrap();
        })
    });
}

/// Six grants: two jobs, a lease whose broker release fails, a job whose slot is quarantined, a
/// held lease with one job waiting behind it. Five broker releases (the quarantined slot is never
/// released), one of them failed.
#[test]
fn every_metric_name_of_the_contract_is_emitted_with_plausible_values() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = current_thread_runtime();
    let mut seen = Seen::default();
    let mid_gauges = metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let broker = TestBroker::new(2);
            // Lease 3 is the explicit lease whose release fails.
            broker.on_release(|lease_id| if lease_id == 3 { Plan::Fail } else { Plan::Ok });
            let root = tempfile::tempdir().unwrap();
            let sup = Supervisor::builder()
                .broker(broker.clone())
                .work_root(root.path())
                .start()
                .await
                .unwrap();
            for id in ["ok-1", "ok-2"] {
                sup.run(JobSpec::new(id).unwrap(), |_ctx| async {
                    Ok::<_, std::io::Error>(())
                })
                .await
                .unwrap();
            }
            let mut lease = sup.acquire().await.unwrap();
            assert_eq!(lease.lease_id().unwrap(), 3);
            assert_eq!(
                lease.release().await.unwrap_err().code(),
                "LEASE_CLEANUP_FAILED"
            );
            let err = sup
                .run(JobSpec::new("evidence").unwrap(), |ctx| async move {
                    common::clobber_temp_dir(&ctx)?;
                    Ok::<_, std::io::Error>(())
                })
                .await
                .unwrap_err();
            assert_eq!(err.code(), "LEASE_CLEANUP_UNCONFIRMED");

            // One usable slot left: hold it and queue a job behind it.
            let mut holder = sup.acquire().await.unwrap();
            let waiter = {
                let sup = sup.clone();
                tokio::spawn(async move {
                    sup.run(JobSpec::new("waiter").unwrap(), |_ctx| async {
                        Ok::<_, std::io::Error>(())
                    })
                    .await
                })
            };
            until("the job waits", || sup.stats().waiting == 1).await;
            let mid = seen.take(&snapshotter);
            holder.release().await.unwrap();
            waiter.await.unwrap().unwrap();
            let stats = sup.stats();
            assert_eq!(stats.acquired_total, 6);
            assert_eq!(stats.released_total, 4);
            assert_eq!(stats.release_failed_total, 1);
            assert_eq!(stats.quarantined, 1);
            broker.assert_quiescent(stats);
            mid
        })
    });
    seen.take(&snapshotter);

    // Gauges while one lease was held, one job waited and one slot sat in quarantine.
    assert_eq!(mid_gauges.get(metric_names::ACTIVE_COUNT), Some(&1.0));
    assert_eq!(mid_gauges.get(metric_names::WAITING_COUNT), Some(&1.0));
    assert_eq!(mid_gauges.get(metric_names::QUARANTINED_COUNT), Some(&1.0));
    // Gauges at the end.
    assert_eq!(seen.gauges.get(metric_names::ACTIVE_COUNT), Some(&0.0));
    assert_eq!(seen.gauges.get(metric_names::WAITING_COUNT), Some(&0.0));
    assert_eq!(seen.gauges.get(metric_names::QUARANTINED_COUNT), Some(&1.0));

    assert_eq!(seen.counters.get(metric_names::ACQUIRE_COUNT), Some(&6));
    assert_eq!(seen.counters.get(metric_names::RELEASE_COUNT), Some(&5));
    assert_eq!(
        seen.counters.get(metric_names::RELEASE_FAILED_COUNT),
        Some(&1)
    );
    for (name, n) in [
        (metric_names::ACQUIRE_DURATION_MS, 6),
        (metric_names::RELEASE_DURATION_MS, 5),
    ] {
        let values = seen
            .histograms
            .get(name)
            .unwrap_or_else(|| panic!("{name} not emitted: {seen:?}"));
        assert_eq!(values.len(), n, "{name}: {values:?}");
        for v in values {
            // Milliseconds, not seconds or nanoseconds: non-negative and well under a minute.
            assert!(v.is_finite() && *v >= 0.0 && *v < 60_000.0, "{name}: {v}");
        }
    }

    // The names are the contract's, spelled out.
    let names = [
        "render_slot.acquire.count",
        "render_slot.acquire.duration_ms",
        "render_slot.release.count",
        "render_slot.release.duration_ms",
        "render_slot.release.failed.count",
        "render_slot.active.count",
        "render_slot.quarantined.count",
        "render_slot.waiting.count",
    ];
    for name in names {
        assert!(
            seen.counters.contains_key(name)
                || seen.gauges.contains_key(name)
                || seen.histograms.contains_key(name),
            "{name} never emitted: {seen:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Traces
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct SpanRec {
    name: &'static str,
    fields: BTreeMap<String, String>,
    parent: Option<usize>,
}

#[derive(Debug, Clone)]
struct EventRec {
    level: Level,
    message: String,
    fields: BTreeMap<String, String>,
    /// The span the event happened in.
    span: Option<usize>,
}

#[derive(Debug, Default)]
struct Log {
    spans: Vec<SpanRec>,
    events: Vec<EventRec>,
}

/// Records every span (with its parent and fields, including fields recorded later) and every
/// event (with the span it happened in). Spans are numbered in creation order: the registry
/// reuses span ids, these numbers are never reused.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Log>>);

struct Seq(usize);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl Recorder {
    fn spans(&self) -> Vec<SpanRec> {
        self.0.lock().spans.clone()
    }

    fn events(&self) -> Vec<EventRec> {
        self.0.lock().events.clone()
    }

    fn event(&self, message: &str) -> EventRec {
        let events = self.events();
        let mut matching = events.iter().filter(|e| e.message == message);
        let found = matching
            .next()
            .unwrap_or_else(|| panic!("no event {message:?} in {events:#?}"))
            .clone();
        assert!(matching.next().is_none(), "event {message:?} seen twice");
        found
    }
}

impl<S> Layer<S> for Recorder
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let parent_id = match attrs.parent() {
            Some(p) => Some(p.clone()),
            None if attrs.is_contextual() => ctx.current_span().id().cloned(),
            None => None,
        };
        let parent = parent_id
            .and_then(|p| ctx.span(&p))
            .and_then(|s| s.extensions().get::<Seq>().map(|s| s.0));
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        let seq = {
            let mut log = self.0.lock();
            log.spans.push(SpanRec {
                name: attrs.metadata().name(),
                fields,
                parent,
            });
            log.spans.len() - 1
        };
        ctx.span(id).unwrap().extensions_mut().insert(Seq(seq));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(seq) = ctx
            .span(id)
            .and_then(|s| s.extensions().get::<Seq>().map(|s| s.0))
        else {
            return;
        };
        values.record(&mut Fields(&mut self.0.lock().spans[seq].fields));
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let span = ctx
            .event_span(event)
            .and_then(|s| s.extensions().get::<Seq>().map(|s| s.0));
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let message = fields.remove("message").unwrap_or_default();
        self.0.lock().events.push(EventRec {
            level: *event.metadata().level(),
            message,
            fields,
            span,
        });
    }
}

fn subscriber(recorder: &Recorder) -> impl Subscriber + Send + Sync {
    tracing_subscriber::registry().with(recorder.clone())
}

/// The job gets slot 1 under lease 2 (a lease holds slot 0), so that every id is distinct from
/// the defaults.
#[tokio::test]
async fn a_job_runs_in_a_leasehold_job_span_with_its_ids_under_the_callers_span() {
    let recorder = Recorder::default();
    let _guard = tracing::subscriber::set_default(subscriber(&recorder));
    let broker = TestBroker::new(2);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap();
    let mut held = sup.acquire().await.unwrap();

    let caller = tracing::info_span!("caller", request = "r-17");
    let (slot, lease) = sup
        .run(JobSpec::new("render-7").unwrap(), |ctx| async move {
            tracing::info!("in body");
            ctx.spawn(async {
                tracing::info!("in sibling");
            })
            .await
            .unwrap();
            // A nested sibling: spawned from a sibling, still in the job's span.
            let inner = ctx.clone();
            ctx.spawn(async move {
                inner
                    .spawn(async {
                        tracing::info!("in nested sibling");
                    })
                    .await
                    .unwrap();
            })
            .await
            .unwrap();
            Ok::<_, std::io::Error>((ctx.slot_id(), ctx.lease_id()))
        })
        .instrument(caller)
        .await
        .unwrap();
    assert_eq!((slot, lease), (1, 2));
    held.release().await.unwrap();

    let spans = recorder.spans();
    let body = recorder.event("in body");
    let job_seq = body.span.expect("the body's event is in no span");
    let job = &spans[job_seq];
    assert_eq!(job.name, "leasehold.job", "{spans:#?}");
    assert_eq!(
        job.fields.get("job_id").map(String::as_str),
        Some("render-7")
    );
    assert_eq!(job.fields.get("slot_id").map(String::as_str), Some("1"));
    assert_eq!(job.fields.get("lease_id").map(String::as_str), Some("2"));

    let parent = &spans[job.parent.expect("the job span has no parent")];
    assert_eq!(parent.name, "caller");
    assert_eq!(
        parent.fields.get("request").map(String::as_str),
        Some("r-17")
    );

    assert_eq!(recorder.event("in sibling").span, Some(job_seq));
    assert_eq!(recorder.event("in nested sibling").span, Some(job_seq));
    assert_eq!(
        spans.iter().filter(|s| s.name == "leasehold.job").count(),
        1,
        "one job, one job span"
    );
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn a_job_started_outside_any_span_has_a_root_job_span() {
    let recorder = Recorder::default();
    let _guard = tracing::subscriber::set_default(subscriber(&recorder));
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    sup.run(JobSpec::new("rootless").unwrap(), |_ctx| async {
        tracing::info!("in body");
        Ok::<_, std::io::Error>(())
    })
    .await
    .unwrap();
    let spans = recorder.spans();
    let job = &spans[recorder.event("in body").span.unwrap()];
    assert_eq!(job.name, "leasehold.job");
    assert_eq!(job.parent, None, "{spans:#?}");
}

/// A dropped lease whose broker release fails: no caller is left, so the failure becomes an
/// ERROR event (besides the sink and the metric).
#[tokio::test]
async fn a_cleanup_failure_with_no_caller_emits_an_error_event() {
    let recorder = Recorder::default();
    let _guard = tracing::subscriber::set_default(subscriber(&recorder));
    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::Fail);
    let (tx, mut sunk) = mpsc::unbounded_channel::<OrphanedFailure>();
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .error_sink(move |f| {
            let _ = tx.send(f.clone());
        })
        .start()
        .await
        .unwrap();
    let lease = sup.acquire().await.unwrap();
    let token = lease.token().unwrap();
    assert!(
        recorder.events().iter().all(|e| e.level != Level::ERROR),
        "an error before any failure: {:#?}",
        recorder.events()
    );
    drop(lease);
    let failure = sunk.recv().await.unwrap();
    assert_eq!(failure.token, token);

    let errors: Vec<EventRec> = recorder
        .events()
        .into_iter()
        .filter(|e| e.level == Level::ERROR)
        .collect();
    assert_eq!(errors.len(), 1, "{errors:#?}");
    let event = &errors[0];
    assert_eq!(
        event.fields.get("code").map(String::as_str),
        Some("LEASE_CLEANUP_FAILED"),
        "{event:#?}"
    );
    assert_eq!(
        event.fields.get("token").map(String::as_str),
        Some(token.to_string().as_str()),
        "{event:#?}"
    );
    broker.assert_quiescent(sup.stats());
}

/// The same for a job whose caller dropped the `run` future: the event names the job.
#[tokio::test]
async fn a_cleanup_failure_of_an_abandoned_job_emits_an_error_event_naming_the_job() {
    let recorder = Recorder::default();
    let _guard = tracing::subscriber::set_default(subscriber(&recorder));
    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::Fail);
    let calls = Arc::new(AtomicUsize::new(0));
    let (tx, mut sunk) = mpsc::unbounded_channel::<OrphanedFailure>();
    let sup = {
        let calls = Arc::clone(&calls);
        Supervisor::builder()
            .broker(broker.clone())
            .error_sink(move |f| {
                calls.fetch_add(1, Ordering::SeqCst);
                let _ = tx.send(f.clone());
            })
            .start()
            .await
            .unwrap()
    };
    let (started_tx, started_rx) = oneshot::channel();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("abandoned").unwrap(), |ctx| async move {
                started_tx.send(()).unwrap();
                ctx.cancelled().await;
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    started_rx.await.unwrap();
    job.abort();
    let failure = sunk.recv().await.unwrap();
    assert_eq!(failure.job_id.as_deref(), Some("abandoned"));
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let errors: Vec<EventRec> = recorder
        .events()
        .into_iter()
        .filter(|e| e.level == Level::ERROR)
        .collect();
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_eq!(
        errors[0].fields.get("job_id").map(String::as_str),
        Some("abandoned")
    );
    assert_eq!(
        errors[0].fields.get("code").map(String::as_str),
        Some("LEASE_CLEANUP_FAILED")
    );
    broker.assert_quiescent(sup.stats());
}
