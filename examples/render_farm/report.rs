//! The summary table, the Chrome/Perfetto trace and the PNG timeline.

use std::path::Path;
use std::time::{Duration, Instant};

use plotters::prelude::*;
use serde_json::{Value, json};

use super::farm::JobRecord;

fn cell(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

fn clip(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_string()
    } else {
        let mut s: String = text.chars().take(max - 3).collect();
        s.push_str("...");
        s
    }
}

/// The summary table: one row per job.
pub fn table(records: &[JobRecord]) -> String {
    let mut out = format!(
        "{:<20} {:<21} {:>4} {:>8} {:>7} {:>8} {:>7} {:>7}  {}\n",
        "job", "outcome", "slot", "wait ms", "run ms", "drain ms", "of GPU", "rel. ms", "note"
    );
    out.push_str(&format!("{}\n", "-".repeat(148)));
    for r in records {
        out.push_str(&format!(
            "{:<20} {:<21} {:>4} {:>8} {:>7} {:>8} {:>7} {:>7}  {}\n",
            r.id,
            r.outcome,
            r.slot.map_or("-".into(), |s| s.to_string()),
            cell(r.wait_ms()),
            cell(r.run_ms()),
            cell(r.drain_ms()),
            cell(r.gpu_wait_ms()),
            r.release_ms()
                .map_or_else(|| "-".into(), |v| format!("{v:.3}")),
            clip(&r.note, 56),
        ));
    }
    out.push_str(
        "wait: run() called -> body starts.  run: the body.  drain: body ended -> broker \
         release starts (worker end,\n  GPU fence, temp dir).  of GPU: the part of the drain \
         until the GPU work queued before the body ended had completed\n  (its own, or another \
         slot's: the slots share one device queue).  rel.: the broker release.\n",
    );
    out
}

/// Phases drawn on a slot's lane (the wait happens before there is a slot).
#[derive(Clone, Copy)]
enum Phase {
    Run,
    DrainGpu,
    DrainGpuOther,
    DrainCleanup,
    Release,
}

impl Phase {
    fn label(self) -> &'static str {
        match self {
            Phase::Run => "run (body)",
            Phase::DrainGpu => "drain: its own GPU work still running",
            Phase::DrainGpuOther => "drain: other slots' GPU work (shared queue)",
            Phase::DrainCleanup => "drain: rest (worker end, fence, temp dir)",
            Phase::Release => "release (broker)",
        }
    }

    fn color(self) -> RGBColor {
        match self {
            Phase::Run => RGBColor(70, 130, 180),
            Phase::DrainGpu => RGBColor(230, 85, 13),
            Phase::DrainGpuOther => RGBColor(250, 170, 130),
            Phase::DrainCleanup => RGBColor(240, 190, 40),
            Phase::Release => RGBColor(40, 160, 70),
        }
    }

    fn trace_name(self) -> &'static str {
        match self {
            Phase::Run => "run",
            Phase::DrainGpu => "drain: GPU fence (own work)",
            Phase::DrainGpuOther => "drain: GPU fence (other slot's work)",
            Phase::DrainCleanup => "drain: cleanup",
            Phase::Release => "release",
        }
    }
}

struct Segment {
    slot: u32,
    phase: Phase,
    start: Instant,
    end: Instant,
}

/// A job's segments on its slot's lane.
fn segments(r: &JobRecord) -> Vec<Segment> {
    let (Some(slot), Some(start), Some(end)) = (r.slot, r.body_start, r.body_end) else {
        return Vec::new();
    };
    let mut out = vec![Segment {
        slot,
        phase: Phase::Run,
        start,
        end,
    }];
    if let Some(rel) = r.release_start {
        // The part of the drain until the GPU work the fence covers had completed: first the
        // lease's own work still running, then other slots' work on the shared queue.
        let gpu_ms = r.gpu_wait_ms().unwrap_or(0.0);
        let idle = (end + Duration::from_secs_f64(gpu_ms / 1e3)).min(rel);
        let own = r
            .gpu_done
            .filter(|_| r.submitted.is_some())
            .map_or(end, |g| g.clamp(end, idle));
        let mut cleanup_from = end;
        for (phase, from, to) in [
            (Phase::DrainGpu, end, own),
            (Phase::DrainGpuOther, own, idle),
        ] {
            if to.saturating_duration_since(from) > Duration::from_micros(300) {
                out.push(Segment {
                    slot,
                    phase,
                    start: from,
                    end: to,
                });
                cleanup_from = to;
            }
        }
        out.push(Segment {
            slot,
            phase: Phase::DrainCleanup,
            start: cleanup_from,
            end: rel,
        });
        if let Some(rel_end) = r.release_end {
            out.push(Segment {
                slot,
                phase: Phase::Release,
                start: rel,
                end: rel_end,
            });
        }
    }
    out
}

fn us(t0: Instant, t: Instant) -> f64 {
    t.saturating_duration_since(t0).as_secs_f64() * 1e6
}

/// Chrome trace events ("X" complete events): one thread per slot, waits in a "queue" process.
pub fn trace(records: &[JobRecord], t0: Instant, slots: u32) -> Value {
    let mut events = vec![
        json!({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "GPU slots"}}),
        json!({"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "waiting for a slot"}}),
    ];
    for s in 0..slots {
        events.push(json!({"ph": "M", "name": "thread_name", "pid": 1, "tid": s,
            "args": {"name": format!("slot {s}")}}));
    }
    for (i, r) in records.iter().enumerate() {
        let args = json!({
            "outcome": r.outcome,
            "note": r.note,
            "lease": r.lease,
            "scene": r.scene_file,
        });
        if let (Some(called), Some(start)) = (r.called, r.body_start.or(r.returned)) {
            events.push(json!({"ph": "M", "name": "thread_name", "pid": 2, "tid": i,
                "args": {"name": r.id}}));
            events.push(json!({
                "ph": "X", "pid": 2, "tid": i, "name": format!("{} wait", r.id),
                "ts": us(t0, called), "dur": us(called, start), "args": args,
            }));
        }
        for seg in segments(r) {
            events.push(json!({
                "ph": "X", "pid": 1, "tid": seg.slot,
                "name": format!("{} {}", r.id, seg.phase.trace_name()),
                "cat": seg.phase.trace_name(),
                "ts": us(t0, seg.start), "dur": us(seg.start, seg.end), "args": args,
            }));
        }
        for (name, t) in [
            ("GPU submitted", r.submitted),
            ("GPU done", r.gpu_done),
            ("GPU queue done (fence)", r.queue_done),
        ] {
            if let (Some(t), Some(slot)) = (t, r.slot) {
                events.push(json!({"ph": "i", "s": "t", "pid": 1, "tid": slot,
                    "name": format!("{} {name}", r.id), "ts": us(t0, t)}));
            }
        }
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

/// Registers the bundled font for plotters' text (no system font libraries).
pub fn register_font() -> Result<(), String> {
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        epaint_default_fonts::HACK_REGULAR,
    )
    .map_err(|_| "the bundled font could not be loaded".to_string())
}

/// Draws the timeline: one lane per slot, bars coloured by phase, a legend on top.
pub fn timeline(
    path: &Path,
    records: &[JobRecord],
    t0: Instant,
    slots: u32,
    title: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let end = records
        .iter()
        .filter_map(|r| r.returned.or(r.release_end))
        .max()
        .unwrap_or(t0);
    let total_ms = (end.saturating_duration_since(t0).as_secs_f64() * 1e3).max(1.0) * 1.01;
    let (width, lane_px) = (1600u32, 120u32);
    let height = 80 + lane_px * slots + 60;
    let mut pixels = vec![255u8; (width * height * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let (head, body) = root.split_vertically(80);
        head.draw(&Text::new(
            title.to_string(),
            (20, 10),
            ("sans-serif", 20).into_font().color(&BLACK),
        ))?;
        // The legend: coloured boxes with their names.
        let mut x = 20;
        for phase in [
            Phase::Run,
            Phase::DrainGpu,
            Phase::DrainGpuOther,
            Phase::DrainCleanup,
            Phase::Release,
        ] {
            head.draw(&Rectangle::new(
                [(x, 44), (x + 22, 62)],
                phase.color().filled(),
            ))?;
            head.draw(&Text::new(
                phase.label(),
                (x + 28, 46),
                ("sans-serif", 14).into_font().color(&BLACK),
            ))?;
            x += 40 + (8.4 * phase.label().len() as f64) as i32;
        }
        let mut chart = ChartBuilder::on(&body)
            .margin_left(10)
            .margin_right(25)
            .margin_bottom(10)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..total_ms, 0f64..f64::from(slots))?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .disable_y_axis()
            .y_labels(0)
            .x_max_light_lines(2)
            .x_desc("milliseconds since the first job was submitted")
            .label_style(("sans-serif", 14))
            .draw()?;
        // Slot 0 on top.
        let lane_y = |slot: u32| f64::from(slots - 1 - slot);
        for slot in 0..slots {
            let (px, py) = chart.backend_coord(&(0.0, lane_y(slot) + 0.5));
            root.draw(&Text::new(
                format!("slot {slot}"),
                (px - 62, py - 8),
                ("sans-serif", 15).into_font().color(&BLACK),
            ))?;
        }
        // At least 2 px wide, so that sub-millisecond releases show.
        let min_ms = total_ms / f64::from(width - 100) * 2.0;
        let ms_of = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1e3;
        for r in records {
            for seg in segments(r) {
                let (x0, x1) = (
                    ms_of(seg.start),
                    ms_of(seg.end).max(ms_of(seg.start) + min_ms),
                );
                let y = lane_y(seg.slot);
                let (y0, y1) = match seg.phase {
                    Phase::Run => (y + 0.30, y + 0.70),
                    _ => (y + 0.35, y + 0.65),
                };
                chart.draw_series([Rectangle::new(
                    [(x0, y0), (x1, y1)],
                    seg.phase.color().filled(),
                )])?;
                chart.draw_series([Rectangle::new(
                    [(x0, y0), (x1, y1)],
                    BLACK.mix(0.35).stroke_width(1),
                )])?;
            }
        }
        // Job names: two rows above each lane and two below, each label in the first row where
        // it does not run into the previous one, kept inside the plot on the right.
        let right_px = chart.backend_coord(&(total_ms, 0.0)).0;
        let rows = [0.94, 0.26, 0.82, 0.14];
        let mut row_end = vec![[i32::MIN; 4]; slots as usize];
        let mut order: Vec<&JobRecord> =
            records.iter().filter(|r| r.body_start.is_some()).collect();
        order.sort_by_key(|r| r.body_start);
        for r in order {
            let (Some(slot), Some(start)) = (r.slot, r.body_start) else {
                continue;
            };
            let short = r.id.split_once('-').map_or(r.id.as_str(), |(_, s)| s);
            let label = match r.outcome.as_str() {
                "OK" => short.to_string(),
                "SKIPPED" => format!("{short} (skipped)"),
                "LEASE_BODY_CANCELLED" => format!("{short} (CANCELLED)"),
                other => format!("{short} ({})", other.trim_start_matches("LEASE_")),
            };
            // Hack at 12 px advances 7.2 px per character.
            let text_px = (label.chars().count() as f64 * 7.2).ceil() as i32 + 8;
            let bar_px = chart.backend_coord(&(ms_of(start), 0.0)).0;
            let x = bar_px.min(right_px - text_px);
            let ends = &mut row_end[slot as usize];
            let row = (0..rows.len())
                .find(|&k| ends[k] <= x)
                .unwrap_or_else(|| (0..rows.len()).min_by_key(|&k| ends[k]).unwrap_or(0));
            ends[row] = x + text_px;
            let (_, y) = chart.backend_coord(&(0.0, lane_y(slot) + rows[row]));
            root.draw(&Text::new(
                label,
                (x, y),
                ("sans-serif", 12).into_font().color(&BLACK),
            ))?;
        }
        root.present()?;
    }
    super::render::write_png(path, width, height, png::ColorType::Rgb, &pixels)?;
    Ok(())
}
