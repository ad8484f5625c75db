//! The rolling timeline: per slot, what held it over the last minute, as segments of one colour
//! each. Pure (times are milliseconds since the console started, given by the caller), fed one
//! sample at a time.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde::Serialize;

/// The most segments kept per slot: a slot whose holder changes at every sample for a minute
/// makes 600 at 10 samples a second; beyond this the oldest go first.
const MAX_SEGMENTS: usize = 600;

/// One stretch of one slot under one holder in one colour.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Segment {
    pub(crate) from_ms: u64,
    pub(crate) to_ms: u64,
    /// The colour class (`run`, `drain`, `drain-gpu`, `release`, `quarantined`).
    pub(crate) color: &'static str,
    /// The job id, or a label for an explicit lease.
    #[serde(serialize_with = "super::json::arc_str")]
    pub(crate) holder: Arc<str>,
}

#[derive(Debug, Default)]
struct Lane {
    segments: VecDeque<Segment>,
    /// The last segment was seen in the latest sample (it extends to now).
    open: bool,
}

/// Every slot's segments over the window.
#[derive(Debug)]
pub(crate) struct Timeline {
    window_ms: u64,
    lanes: BTreeMap<u32, Lane>,
}

/// What one slot showed in one sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) slot: u32,
    pub(crate) color: &'static str,
    pub(crate) holder: Arc<str>,
}

impl Timeline {
    pub(crate) fn new(window_ms: u64) -> Self {
        Self {
            window_ms,
            lanes: BTreeMap::new(),
        }
    }

    /// Applies one sample taken at `now_ms`: a slot that shows the same holder in the same
    /// colour as in the previous sample extends its segment to now; a change closes the
    /// previous segment at now (the change happened between the two samples) and opens a new
    /// one; a slot not held any more closes its segment at now. Segments that ended before the
    /// window are dropped.
    pub(crate) fn sample(&mut self, now_ms: u64, held: &[Held]) {
        for lane in self.lanes.values_mut() {
            if lane.open {
                lane.open = false;
                if let Some(last) = lane.segments.back_mut() {
                    last.to_ms = now_ms;
                }
            }
        }
        for h in held {
            let lane = self.lanes.entry(h.slot).or_default();
            let continues = lane.segments.back().is_some_and(|last| {
                last.to_ms == now_ms && last.color == h.color && last.holder == h.holder
            });
            // Only a segment that was open ends at now here (the loop above set it): a closed
            // one ended at an earlier sample.
            if continues {
                lane.open = true;
                continue;
            }
            lane.segments.push_back(Segment {
                from_ms: now_ms,
                to_ms: now_ms,
                color: h.color,
                holder: Arc::clone(&h.holder),
            });
            lane.open = true;
            if lane.segments.len() > MAX_SEGMENTS {
                lane.segments.pop_front();
            }
        }
        let horizon = now_ms.saturating_sub(self.window_ms);
        self.lanes.retain(|_, lane| {
            while lane.segments.front().is_some_and(|s| s.to_ms < horizon) {
                lane.segments.pop_front();
            }
            !lane.segments.is_empty()
        });
    }

    /// The slots with a segment in the window.
    pub(crate) fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.lanes.keys().copied()
    }

    /// The window, for the page's scale.
    pub(crate) fn window_ms(&self) -> u64 {
        self.window_ms
    }

    /// One slot's segments, oldest first.
    pub(crate) fn segments(&self, slot: u32) -> impl Iterator<Item = &Segment> + '_ {
        self.lanes
            .get(&slot)
            .into_iter()
            .flat_map(|lane| lane.segments.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(slot: u32, color: &'static str, holder: &str) -> Held {
        Held {
            slot,
            color,
            holder: Arc::from(holder),
        }
    }

    fn spans(t: &Timeline, slot: u32) -> Vec<(u64, u64, &'static str, String)> {
        t.segments(slot)
            .map(|s| (s.from_ms, s.to_ms, s.color, s.holder.to_string()))
            .collect()
    }

    #[test]
    fn a_job_running_then_draining_then_gone_makes_two_adjacent_segments() {
        let mut t = Timeline::new(60_000);
        t.sample(0, &[held(0, "run", "a")]);
        t.sample(100, &[held(0, "run", "a")]);
        t.sample(200, &[held(0, "drain", "a")]);
        t.sample(300, &[held(0, "drain", "a")]);
        t.sample(400, &[]);
        t.sample(500, &[]);
        assert_eq!(
            spans(&t, 0),
            vec![(0, 200, "run", "a".into()), (200, 400, "drain", "a".into())]
        );
    }

    #[test]
    fn the_same_holder_after_a_gap_is_a_new_segment() {
        let mut t = Timeline::new(60_000);
        t.sample(0, &[held(1, "run", "a")]);
        t.sample(100, &[]);
        t.sample(200, &[held(1, "run", "a")]);
        assert_eq!(
            spans(&t, 1),
            vec![(0, 100, "run", "a".into()), (200, 200, "run", "a".into())]
        );
    }

    #[test]
    fn segments_older_than_the_window_are_dropped_and_empty_lanes_go() {
        let mut t = Timeline::new(1_000);
        t.sample(0, &[held(0, "run", "a"), held(1, "run", "b")]);
        t.sample(100, &[held(1, "run", "b")]);
        t.sample(2_000, &[held(1, "release", "b")]);
        assert_eq!(t.slots().collect::<Vec<_>>(), vec![1]);
        assert_eq!(
            spans(&t, 1),
            vec![
                (0, 2_000, "run", "b".into()),
                (2_000, 2_000, "release", "b".into())
            ]
        );
        t.sample(3_500, &[]);
        assert_eq!(spans(&t, 1), vec![(2_000, 3_500, "release", "b".into())]);
        t.sample(5_000, &[]);
        assert_eq!(t.slots().count(), 0);
    }

    #[test]
    fn a_lane_keeps_at_most_its_cap_of_segments() {
        let mut t = Timeline::new(u64::MAX);
        for i in 0..(MAX_SEGMENTS as u64 + 10) {
            let holder = if i % 2 == 0 { "a" } else { "b" };
            t.sample(i * 100, &[held(0, "run", holder)]);
        }
        assert_eq!(t.segments(0).count(), MAX_SEGMENTS);
        assert_eq!(t.segments(0).next().unwrap().from_ms, 1_000);
    }
}
