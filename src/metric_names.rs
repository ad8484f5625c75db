//! Metric names, emitted through the [`metrics`] facade (install any exporter).

/// Counter: slots the broker granted to this supervisor (a k-slot lease counts k), exactly
/// as [`Stats::acquired_total`](crate::Stats::acquired_total) counts them: a grant whose
/// caller had left before the hand-over counts too, and its slot goes straight back.
pub const ACQUIRE_COUNT: &str = "render_slot.acquire.count";
/// Histogram: milliseconds from joining the queue to the grant (one sample per lease).
pub const ACQUIRE_DURATION_MS: &str = "render_slot.acquire.duration_ms";
/// Counter: broker releases finished, any outcome (one per slot).
pub const RELEASE_COUNT: &str = "render_slot.release.count";
/// Histogram: milliseconds a broker release took (one sample per slot).
pub const RELEASE_DURATION_MS: &str = "render_slot.release.duration_ms";
/// Counter: broker releases that failed or timed out (one per slot).
pub const RELEASE_FAILED_COUNT: &str = "render_slot.release.failed.count";
/// Gauge: slots held and not quarantined (running, draining or releasing).
pub const ACTIVE_COUNT: &str = "render_slot.active.count";
/// Counter: leases a distributed broker saw expire while orphaned.
pub const ORPHAN_EXPIRED_COUNT: &str = "render_slot.orphan_expired.count";
/// Gauge: quarantined slots.
pub const QUARANTINED_COUNT: &str = "render_slot.quarantined.count";
/// Gauge: callers waiting for a slot.
pub const WAITING_COUNT: &str = "render_slot.waiting.count";
/// Counter: leases held past the held-too-long threshold
/// ([`SupervisorBuilder::held_warning`](crate::SupervisorBuilder::held_warning)), each
/// counted once.
pub const HELD_TOO_LONG_COUNT: &str = "render_slot.held_too_long.count";
/// Counter: failures with no caller left that the error sink's queue had no room for (the
/// sink fell behind, or blocks); each is still logged.
pub const SINK_DROPPED_COUNT: &str = "render_slot.sink.dropped.count";
