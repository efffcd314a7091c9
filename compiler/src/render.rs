//! Pictures and traces of a plan: the per-device Gantt chart of one step (`timeline.svg`),
//! the memory breakdown per device (`memory.svg`) and a Chrome trace (`trace.json`, opens
//! in Perfetto). The executor writes its measured trace in the same trace format.

use std::fmt::Write as _;

use pipec_plan::{DeviceId, Instr, Phase, Plan};

use crate::memory::human_bytes;
use crate::simulate::Timeline;

fn colour(phase: Phase) -> &'static str {
    match phase {
        Phase::Forward => "#4e79a7",
        Phase::Backward => "#59a14f",
        Phase::BackwardInput => "#8cd17d",
        Phase::BackwardWeight => "#b6992d",
        Phase::Recompute => "#76b7b2",
        Phase::Communication => "#e15759",
        Phase::Collective => "#f28e2b",
        Phase::Optimizer => "#b07aa1",
        Phase::Memory => "#bab0ac",
    }
}

/// An expert-parallel all-to-all inside a pass: its own colour and legend entry, apart from
/// the collectives of the communication engine.
const ALL_TO_ALL_COLOUR: &str = "#9c755f";

/// The colour of an event: its phase's, or the all-to-all's.
fn event_colour(e: &crate::simulate::Event) -> &'static str {
    if e.all_to_all {
        ALL_TO_ALL_COLOUR
    } else {
        colour(e.phase)
    }
}

fn label(phase: Phase) -> &'static str {
    match phase {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
        Phase::BackwardInput => "backward (input)",
        Phase::BackwardWeight => "backward (weights)",
        Phase::Recompute => "recompute",
        Phase::Communication => "waiting for a transfer",
        Phase::Collective => "collective (all-reduce, reduce-scatter, all-gather)",
        Phase::Optimizer => "optimizer step",
        Phase::Memory => "memory",
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Formats seconds with a sensible unit.
pub fn human_time(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

/// The Gantt chart of one step: a row per device, a box per compute (microbatch number in
/// it), transfers waited for in red, idle time white.
/// Beyond this many devices the timeline picture shows one row per stage (its first
/// replica's device); `trace.json` keeps every device.
pub const TIMELINE_MAX_ROWS: usize = 64;

pub fn timeline_svg(plan: &Plan, timeline: &Timeline) -> String {
    let all: Vec<DeviceId> = plan.devices.iter().map(|d| d.id).collect();
    let devices: Vec<DeviceId> = if all.len() <= TIMELINE_MAX_ROWS {
        all.clone()
    } else {
        // each device once, in the order of the stages it first holds (a V's device holds
        // a stage on the way down and one on the way up)
        let mut rows: Vec<DeviceId> = Vec::new();
        for d in plan.stages.iter().filter_map(|s| s.replicas.first().copied()) {
            if !rows.contains(&d) {
                rows.push(d);
            }
        }
        rows
    };
    let mut by_device: std::collections::HashMap<DeviceId, Vec<&crate::simulate::Event>> =
        std::collections::HashMap::new();
    for e in &timeline.events {
        by_device.entry(e.device).or_default().push(e);
    }
    let row_h = 26.0;
    let left = 64.0;
    let width = 1100.0;
    let top = 44.0;
    let legend_h = 66.0;
    let height = top + row_h * devices.len() as f64 + legend_h + 24.0;
    let t = timeline.step_time.max(1e-12);
    let x = |s: f64| left + s / t * (width - left - 16.0);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{left}" y="18" font-size="14" font-weight="bold">{}: {} on {} — step {}, bubble {:.1}%</text>"#,
        escape(&plan.name),
        escape(plan.schedule.kind.name()),
        escape(&plan.partition),
        human_time(timeline.step_time),
        plan.simulation.bubble_fraction * 100.0
    );
    let _ = writeln!(
        svg,
        r##"<text x="{left}" y="34" fill="#555">predicted timeline of one training step; numbers are microbatches, s = stage; a thin bar is a collective in flight{}</text>"##,
        if devices.len() < all.len() {
            format!(
                "; {} of {} devices: each stage's first replica (trace.json has them all)",
                devices.len(),
                all.len()
            )
        } else {
            String::new()
        }
    );
    for (row, dev) in devices.iter().enumerate() {
        let y = top + row as f64 * row_h;
        let _ = writeln!(svg, r##"<text x="8" y="{}" dominant-baseline="middle">{dev}</text>"##, y + row_h / 2.0);
        let _ = writeln!(
            svg,
            r##"<rect x="{left}" y="{}" width="{}" height="{}" fill="#f7f7f7" stroke="#ddd"/>"##,
            y + 2.0,
            width - left - 16.0,
            row_h - 4.0
        );
        let label_stages = plan.stages.len() > devices.len() || plan.devices.iter().any(|d| d.stages.len() > 1);
        for e in by_device.get(dev).into_iter().flatten() {
            draw_event(&mut svg, plan, *dev, e, (y, row_h), &x, label_stages);
        }
    }
    legend(&mut svg, timeline, left, top + row_h * devices.len() as f64 + 18.0, width);
    svg.push_str("</svg>\n");
    svg
}

/// One event of a device's row (a row from `y`, `row_h` high): a box with its microbatch
/// (and stage, when `label_stages`), or a thin bar for a collective in flight.
fn draw_event(
    svg: &mut String,
    plan: &Plan,
    dev: DeviceId,
    e: &crate::simulate::Event,
    (y, row_h): (f64, f64),
    x: &dyn Fn(f64) -> f64,
    label_stages: bool,
) {
    if e.end <= e.start || e.phase == Phase::Memory {
        return;
    }
    let ins = plan.instruction(dev, e.index);
    let (x0, x1) = (x(e.start), x(e.end));
    let w = (x1 - x0).max(0.5);
    let title = ins.map(|i| format!("{i}: {} → {}", human_time(e.start), human_time(e.end))).unwrap_or_default();
    if e.background {
        // a collective in flight on the communication engine: a thin bar along the
        // bottom of the row, under whatever the device computes meanwhile
        let _ = writeln!(
            svg,
            r#"<rect x="{x0:.2}" y="{}" width="{w:.2}" height="4" fill="{}" opacity="0.8"><title>in flight: {}</title></rect>"#,
            y + row_h - 6.0,
            event_colour(e),
            escape(&title)
        );
        return;
    }
    let _ = writeln!(
        svg,
        r#"<rect x="{x0:.2}" y="{}" width="{w:.2}" height="{}" fill="{}" stroke="white" stroke-width="0.5"><title>{}</title></rect>"#,
        y + 3.0,
        row_h - 6.0,
        event_colour(e),
        escape(&title)
    );
    if let Some(i) = ins {
        if matches!(e.phase, Phase::Forward | Phase::Backward | Phase::BackwardInput | Phase::BackwardWeight)
            && w > 12.0
        {
            let text = match (i.microbatch(), label_stages) {
                (Some(m), true) => format!("{}s{}", m.0, i.stage().0),
                (Some(m), false) => format!("{}", m.0),
                _ => String::new(),
            };
            let _ = writeln!(
                svg,
                r#"<text x="{:.2}" y="{}" fill="white" text-anchor="middle" dominant-baseline="middle" font-size="10">{text}</text>"#,
                x0 + w / 2.0,
                y + row_h / 2.0
            );
        }
    }
}

/// The timeline's legend (the kinds of work it shows, idle) and its time axis, at `ly`.
fn legend(svg: &mut String, timeline: &Timeline, left: f64, ly: f64, width: f64) {
    let used: Vec<(&str, &str)> = [
        Phase::Forward,
        Phase::Backward,
        Phase::BackwardInput,
        Phase::BackwardWeight,
        Phase::Recompute,
        Phase::Communication,
        Phase::Collective,
        Phase::Optimizer,
    ]
    .into_iter()
    .filter(|p| timeline.events.iter().any(|e| e.phase == *p && !e.all_to_all && e.end > e.start))
    .map(|p| (colour(p), label(p)))
    .collect();
    // every colour drawn has its entry: the all-to-all's too
    let exchanges = timeline.events.iter().any(|e| e.all_to_all && e.end > e.start);
    let used = used.into_iter().chain(exchanges.then_some((ALL_TO_ALL_COLOUR, "all-to-all (expert parallelism)")));
    let (mut lx, mut ly) = (left, ly);
    let entries: Vec<(&str, &str)> = used.chain([("#f7f7f7", "idle (bubble)")]).collect();
    for (i, (c, text)) in entries.iter().enumerate() {
        // a second row when the first is full
        if lx + 30.0 + text.len() as f64 * 6.0 > width {
            lx = left;
            ly += 18.0;
        }
        // idle's light swatch gets an outline
        let stroke = if i + 1 == entries.len() { r##" stroke="#ddd""## } else { "" };
        let _ = writeln!(
            svg,
            r#"<rect x="{lx}" y="{ly}" width="12" height="12" fill="{c}"{stroke}/><text x="{}" y="{}">{text}</text>"#,
            lx + 16.0,
            ly + 10.0
        );
        lx += 30.0 + text.len() as f64 * 6.0;
    }
    let _ = writeln!(
        svg,
        r##"<text x="{left}" y="{}" fill="#555">0</text><text x="{}" y="{}" fill="#555" text-anchor="end">{}</text>"##,
        ly + 30.0,
        width - 16.0,
        ly + 30.0,
        human_time(timeline.step_time)
    );
}

/// Stacked bars of each device's memory against its capacity.
/// Round values up to `max` bytes for an axis, with their labels: multiples of 1, 2 or 5
/// times a power of ten of the unit `max` is written in (B, KiB, MiB, GiB, TiB), 3 to 10 of
/// them, 0 first.
pub fn byte_ticks(max: f64) -> Vec<(f64, String)> {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut u = 0;
    while u + 1 < units.len() && max >= 1024f64.powi(u as i32 + 1) {
        u += 1;
    }
    let unit = 1024f64.powi(u as i32);
    let span = (max / unit).max(1e-9);
    let raw = span / 5.0;
    let pow = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * pow).find(|s| *s >= raw).unwrap_or(10.0 * pow);
    let mut out = Vec::new();
    let mut k = 0.0;
    while k * step <= span * (1.0 + 1e-9) && out.len() < 12 {
        let v = k * step;
        let label = if v == 0.0 { "0".to_string() } else { format!("{} {}", trim_number(v), units[u]) };
        out.push((v * unit, label));
        k += 1.0;
    }
    out
}

/// A number without a trailing `.0`, at most 2 decimals.
fn trim_number(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

pub fn memory_svg(plan: &Plan) -> String {
    let parts: [(&str, &str); 7] = [
        ("weights", "#4e79a7"),
        ("gradients", "#59a14f"),
        ("optimizer", "#b07aa1"),
        ("activations", "#f28e2b"),
        ("transient", "#ffbe7d"),
        ("buffers", "#e15759"),
        ("workspace", "#bab0ac"),
    ];
    // devices whose memory is the same are one bar, labelled with their set
    let mut groups: Vec<(&pipec_plan::plan::MemoryBreakdown, Vec<DeviceId>)> = Vec::new();
    for d in &plan.devices {
        match groups.iter_mut().find(|(m, _)| **m == d.memory) {
            Some((_, ids)) => ids.push(d.id),
            None => groups.push((&d.memory, vec![d.id])),
        }
    }
    let n = groups.len().max(1);
    let bar_w = (900.0 / n as f64).clamp(6.0, 60.0);
    let left = 80.0;
    let top = 50.0;
    let h = 300.0;
    // the labels under the bars, slanted; past 64 bars every k-th is labelled
    let label_every = n.div_ceil(64);
    let labels: Vec<String> = groups.iter().map(|(_, ids)| pipec_plan::instr::devices_text(ids)).collect();
    let label_h = labels.iter().map(|l| l.chars().count()).max().unwrap_or(2) as f64 * 4.6 + 16.0;
    let width = left + n as f64 * (bar_w + 6.0) + 180.0;
    let max = plan.devices.iter().map(|d| d.memory.capacity.max(d.memory.total)).max().unwrap_or(1).max(1) as f64;
    let y = |b: f64| top + h - b / max * h;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{:.0}" font-family="sans-serif" font-size="11">"#,
        top + h + label_h + 40.0
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{left}" y="20" font-size="14" font-weight="bold">{}: memory per device ({} layout){}</text>"#,
        escape(&plan.name),
        escape(&plan.partition),
        if groups.len() < plan.devices.len() {
            format!(", {} devices in {} bars of identical devices", plan.devices.len(), groups.len())
        } else {
            String::new()
        }
    );
    for (i, ((m, _), name)) in groups.iter().zip(&labels).enumerate() {
        let x = left + i as f64 * (bar_w + 6.0);
        let mut acc = 0.0;
        for (part, c) in parts {
            let v = match part {
                "weights" => m.weights,
                "gradients" => m.gradients,
                "optimizer" => m.optimizer,
                "activations" => m.activations,
                "transient" => m.transient,
                "buffers" => m.buffers,
                _ => m.workspace,
            } as f64;
            if v <= 0.0 {
                continue;
            }
            let _ = writeln!(
                svg,
                r#"<rect x="{x:.1}" y="{:.1}" width="{bar_w:.1}" height="{:.1}" fill="{c}"><title>{}: {part} {}</title></rect>"#,
                y(acc + v),
                y(acc) - y(acc + v),
                escape(name),
                human_bytes(v as u64)
            );
            acc += v;
        }
        let cap = y(m.capacity as f64);
        let over = m.total > m.capacity;
        let _ = writeln!(
            svg,
            r#"<line x1="{:.1}" x2="{:.1}" y1="{cap:.1}" y2="{cap:.1}" stroke="{}" stroke-width="2"/>"#,
            x - 2.0,
            x + bar_w + 2.0,
            if over { "red" } else { "black" }
        );
        if i % label_every == 0 {
            let (lx, ly) = (x + bar_w / 2.0, top + h + 10.0);
            let _ = writeln!(
                svg,
                r#"<text transform="translate({lx:.1} {ly:.1}) rotate(35)" text-anchor="start">{}</text>"#,
                escape(name)
            );
        }
    }
    // the axes: bytes up the side at round values, with light grid lines across, and titles
    let right = left + n as f64 * (bar_w + 6.0);
    for (tick, label) in byte_ticks(max) {
        let ty = y(tick);
        let _ = writeln!(
            svg,
            r##"<line x1="{:.1}" x2="{right:.1}" y1="{ty:.1}" y2="{ty:.1}" stroke="#e4e4e4"/><line x1="{:.1}" x2="{left}" y1="{ty:.1}" y2="{ty:.1}" stroke="#555"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">{label}</text>"##,
            left,
            left - 4.0,
            left - 6.0,
            ty + 4.0
        );
    }
    let _ = writeln!(
        svg,
        r##"<line x1="{left}" x2="{left}" y1="{top}" y2="{}" stroke="#555"/><line x1="{left}" x2="{right:.1}" y1="{}" y2="{}" stroke="#555"/>"##,
        top + h,
        top + h,
        top + h
    );
    let _ = writeln!(
        svg,
        r##"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle" fill="#555">bytes per device</text><text x="{:.1}" y="{}" text-anchor="middle" fill="#555">device</text>"##,
        top + h / 2.0,
        (left + right) / 2.0,
        top + h + label_h + 24.0
    );
    let lx = right + 20.0;
    for (i, (name, c)) in parts.iter().enumerate() {
        let ly = top + i as f64 * 18.0;
        let _ = writeln!(
            svg,
            r#"<rect x="{lx}" y="{ly}" width="12" height="12" fill="{c}"/><text x="{}" y="{}">{name}</text>"#,
            lx + 16.0,
            ly + 10.0
        );
    }
    let ly = top + parts.len() as f64 * 18.0 + 6.0;
    let _ = writeln!(
        svg,
        r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="black" stroke-width="2"/><text x="{}" y="{}">capacity</text>"#,
        lx + 12.0,
        lx + 16.0,
        ly + 4.0
    );
    svg.push_str("</svg>\n");
    svg
}

/// A Chrome trace event for one instruction.
pub fn trace_event(device: DeviceId, ins: &Instr, start_s: f64, end_s: f64) -> serde_json::Value {
    serde_json::json!({
        "name": ins.to_string(),
        "cat": format!("{:?}", ins.phase()).to_lowercase(),
        "ph": "X",
        "pid": 0,
        "tid": device.0,
        "ts": start_s * 1e6,
        "dur": ((end_s - start_s) * 1e6).max(0.0),
    })
}

/// The predicted step as a Chrome trace (one track per device), as JSON text: written
/// directly, since a 1,024-device plan has hundreds of thousands of events (each one is
/// what `trace_event` gives).
pub fn trace_json(plan: &Plan, timeline: &Timeline) -> String {
    let mut out = String::with_capacity(64 + timeline.events.len() * 120);
    out.push_str("{\"traceEvents\":[");
    let mut first = true;
    let mut sep = |out: &mut String| {
        if !first {
            out.push(',');
        }
        first = false;
    };
    for d in &plan.devices {
        sep(&mut out);
        let _ = write!(
            out,
            r#"{{"name":"thread_name","ph":"M","pid":0,"tid":{0},"args":{{"name":"device {0}"}}}}"#,
            d.id.0
        );
    }
    if timeline.events.iter().any(|e| e.background) {
        // collectives in flight on the devices' communication engines: a second process
        sep(&mut out);
        out.push_str(r#"{"name":"process_name","ph":"M","pid":1,"args":{"name":"communication engine"}}"#);
    }
    for e in &timeline.events {
        if e.end <= e.start {
            continue;
        }
        if let Some(ins) = plan.instruction(e.device, e.index) {
            sep(&mut out);
            let name = serde_json::Value::String(ins.to_string());
            let _ = write!(
                out,
                r#"{{"name":{name},"cat":"{}","ph":"X","pid":{},"tid":{},"ts":{},"dur":{}}}"#,
                format!("{:?}", ins.phase()).to_lowercase(),
                u8::from(e.background),
                e.device.0,
                serde_json::Value::from(e.start * 1e6),
                serde_json::Value::from(((e.end - e.start) * 1e6).max(0.0))
            );
        }
    }
    let _ = write!(
        out,
        r#"],"displayTimeUnit":"ms","otherData":{{"source":"pipec compile (predicted)","plan":{}}}}}"#,
        serde_json::Value::String(plan.name.clone())
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An axis runs from 0 past every round value up to the largest, in the unit the
    /// largest is written in: 3 to 12 ticks at 1, 2 or 5 times a power of ten.
    #[test]
    fn byte_ticks_are_round_values_in_the_largest_unit() {
        let gib = 1024f64.powi(3);
        let ticks = byte_ticks(80.0 * gib);
        let labels: Vec<&str> = ticks.iter().map(|(_, l)| l.as_str()).collect();
        assert_eq!(labels, ["0", "20 GiB", "40 GiB", "60 GiB", "80 GiB"]);
        for max in [1.0, 700.0, 3000.0, 5e6, 1.3e9, 2.5e11, 7e13] {
            let t = byte_ticks(max);
            assert!((3..=12).contains(&t.len()), "{max}: {t:?}");
            assert_eq!(t[0].0, 0.0);
            assert!(t.last().is_some_and(|(v, _)| *v <= max * (1.0 + 1e-9)), "{max}: {t:?}");
        }
    }
}
