//! The charts of the last minutes: per second, the job ends (throughput), the deepest queue,
//! and the waits and drains of the leases that started or ended in it (p50 / p99). Pure: the
//! sampler feeds it what each sample saw. A view shows complete seconds only: the second in
//! progress has seen only part of its ends ("throughput now 0" while jobs end at 2 a second),
//! so the view's last value, which the page calls "now", is the last second that has ended.

use std::collections::VecDeque;

use serde::Serialize;

/// How many samples of waits or drains one second keeps, at most (enough for its percentiles;
/// the memory stays bounded however many jobs end in a second).
const PER_SECOND: usize = 2048;

#[derive(Default)]
struct Bucket {
    second: u64,
    ends: u32,
    queue: usize,
    waits: Vec<u64>,
    drains: Vec<u64>,
}

/// A ring of per-second buckets: the last `window_s` complete seconds and the one in progress.
pub(crate) struct Charts {
    /// The seconds kept: the window and the second in progress.
    keep_s: u64,
    buckets: VecDeque<Bucket>,
}

/// The charts as the page draws them: one value per complete second, oldest first (`null`
/// where a second had nothing to measure); the last is the second that ended last.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub(crate) struct ChartsView {
    /// The first second (since the console started) the arrays describe.
    pub(crate) from_s: u64,
    /// The second in progress, not in the arrays (the arrays end at `now_s - 1`).
    pub(crate) now_s: u64,
    /// Job ends per second.
    pub(crate) throughput: Vec<u32>,
    /// The deepest the queue was in the second.
    pub(crate) queue: Vec<usize>,
    /// The wait of the leases that started in the second (as the queue listing showed it).
    pub(crate) wait_p50_ms: Vec<Option<u64>>,
    pub(crate) wait_p99_ms: Vec<Option<u64>>,
    /// The drain (from the body's end to the release) of the leases that ended in the second.
    pub(crate) drain_p99_ms: Vec<Option<u64>>,
}

impl Charts {
    pub(crate) fn new(window_s: u64) -> Self {
        Self {
            keep_s: window_s.max(1) + 1,
            buckets: VecDeque::new(),
        }
    }

    /// The bucket of `now_ms`'s second: the seconds without a sample in between are empty
    /// buckets, and those older than the window go.
    fn at(&mut self, now_ms: u64) -> &mut Bucket {
        let second = now_ms / 1000;
        let next = self.buckets.back().map_or(second, |b| b.second + 1);
        for s in next.max(second.saturating_sub(self.keep_s - 1))..=second {
            self.buckets.push_back(Bucket {
                second: s,
                ..Bucket::default()
            });
        }
        while self
            .buckets
            .front()
            .is_some_and(|b| b.second + self.keep_s <= second)
        {
            self.buckets.pop_front();
        }
        self.buckets
            .iter_mut()
            .rev()
            .find(|b| b.second == second)
            .expect("the current second's bucket was just made")
    }

    pub(crate) fn queue(&mut self, now_ms: u64, waiting: usize) {
        let b = self.at(now_ms);
        b.queue = b.queue.max(waiting);
    }

    pub(crate) fn started(&mut self, now_ms: u64, waited_ms: Option<u64>) {
        let b = self.at(now_ms);
        if let Some(w) = waited_ms
            && b.waits.len() < PER_SECOND
        {
            b.waits.push(w);
        }
    }

    pub(crate) fn ended(&mut self, now_ms: u64, drain_ms: Option<u64>) {
        let b = self.at(now_ms);
        b.ends += 1;
        if let Some(d) = drain_ms
            && b.drains.len() < PER_SECOND
        {
            b.drains.push(d);
        }
    }

    /// The complete seconds of the window, as of `now_ms` (the second in progress left out).
    pub(crate) fn view(&mut self, now_ms: u64) -> ChartsView {
        self.at(now_ms);
        let now_s = now_ms / 1000;
        let done = || self.buckets.iter().take_while(|b| b.second < now_s);
        ChartsView {
            from_s: self.buckets.front().map_or(now_s, |b| b.second),
            now_s,
            throughput: done().map(|b| b.ends).collect(),
            queue: done().map(|b| b.queue).collect(),
            wait_p50_ms: done().map(|b| quantile(&b.waits, 50)).collect(),
            wait_p99_ms: done().map(|b| quantile(&b.waits, 99)).collect(),
            drain_p99_ms: done().map(|b| quantile(&b.drains, 99)).collect(),
        }
    }
}

/// The nearest-rank `q`th percentile, if there is any value.
fn quantile(values: &[u64], q: usize) -> Option<u64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let rank = (q * sorted.len()).div_ceil(100).max(1);
    Some(sorted[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_second_counts_its_ends_its_deepest_queue_and_its_percentiles() {
        let mut c = Charts::new(60);
        c.queue(100, 3);
        c.queue(900, 7);
        c.queue(1500, 2);
        for d in 1..=100 {
            c.ended(1200, Some(d));
        }
        c.started(1300, Some(40));
        c.started(1400, None);
        c.ended(2100, Some(5));
        let v = c.view(2500);
        assert_eq!((v.from_s, v.now_s), (0, 2));
        // Second 2 is in progress: its end is not shown yet.
        assert_eq!(v.throughput, [0, 100]);
        assert_eq!(v.queue, [7, 2]);
        assert_eq!(v.drain_p99_ms, [None, Some(99)]);
        assert_eq!(v.wait_p50_ms, [None, Some(40)]);
        let v = c.view(3000);
        assert_eq!(v.throughput, [0, 100, 1], "once it has ended, it is");
    }

    /// "throughput now 0" while jobs ended at 2 a second: the last value of a view is the last
    /// complete second, never the one in progress.
    #[test]
    fn a_view_ends_at_the_last_complete_second() {
        let mut c = Charts::new(300);
        for at in [10_100, 10_400, 10_900] {
            c.ended(at, Some(1));
        }
        let v = c.view(11_050);
        assert_eq!(v.from_s + v.throughput.len() as u64, v.now_s);
        assert_eq!(v.throughput.last(), Some(&3));
        assert_eq!(v.drain_p99_ms.last(), Some(&Some(1)));
    }

    #[test]
    fn the_window_keeps_its_last_seconds_and_fills_the_gaps() {
        let mut c = Charts::new(5);
        c.ended(0, None);
        c.ended(3_000, None);
        let v = c.view(4_000);
        assert_eq!(
            v.throughput,
            [1, 0, 0, 1],
            "the silent seconds are there, empty"
        );
        let v = c.view(9_000);
        assert_eq!(v.from_s, 4);
        assert_eq!(
            v.throughput,
            [0, 0, 0, 0, 0],
            "the window's 5 complete seconds"
        );
        // A jump far past the window: only the window's seconds are made.
        let v = c.view(1_000_000);
        assert_eq!(v.throughput.len(), 5);
        assert_eq!(v.from_s, 995);
    }
}
