//! `timeline.html`: one self-contained page per run. An SVG timeline with the nemesis intervals,
//! leader changes, every client request as a bar (resumes as ticks), every decoder acquire as a
//! dot on its generation's row (an owner change where the epoch is above 1), and a scatter of
//! append latency over time; below it, the verdicts.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::Value;

use super::decoder_ops::DecoderOp;

use super::workload::RequestRecord;
use super::RunSummary;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

pub fn timeline(
    summary: &RunSummary,
    reqs: &[RequestRecord],
    nemesis: &[Value],
    leaders: &[Value],
    decoder_ops: &[DecoderOp],
) -> String {
    let (t0, t1) = time_span(reqs, nemesis);
    let width = 1400.0;
    let left = 150.0;
    let x = |t: u64| left + (t.saturating_sub(t0)) as f64 / (t1 - t0) as f64 * (width - left - 10.0);
    let row_h = 14.0;
    let fault_rows: Vec<&str> = {
        let mut v: Vec<&str> = nemesis.iter().filter_map(|n| n["fault"].as_str()).collect();
        v.sort();
        v.dedup();
        v
    };
    let lat_h = 120.0;
    let top_req = 30.0 + row_h * (fault_rows.len() as f64 + 1.0);
    let height = top_req + row_h * reqs.len() as f64 + lat_h + 60.0;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" font-size="10">"#
    );
    seconds_grid(&mut svg, &x, t0, t1, height);
    fault_layer(&mut svg, &x, nemesis, &fault_rows, row_h);
    leader_layer(&mut svg, &x, leaders, t0, height);
    request_layer(&mut svg, &x, reqs, top_req, row_h);
    acquire_layer(&mut svg, &x, reqs, decoder_ops, top_req, row_h);
    latency_layer(
        &mut svg,
        &x,
        decoder_ops,
        top_req + row_h * reqs.len() as f64 + 20.0,
        lat_h,
    );
    svg.push_str("</svg>");
    page(summary, &svg)
}

/// The time the run spans, in µs: from the first request or fault to the last (never empty).
fn time_span(reqs: &[RequestRecord], nemesis: &[Value]) -> (u64, u64) {
    let mut t0 = u64::MAX;
    let mut t1 = 0u64;
    for r in reqs {
        t0 = t0.min(r.invoke_us);
        t1 = t1.max(r.complete_us);
    }
    for n in nemesis {
        t0 = t0.min(n["start_us"].as_u64().unwrap_or(t0));
        t1 = t1.max(n["end_us"].as_u64().unwrap_or(t1));
    }
    if t0 >= t1 {
        t1 = t0.saturating_add(1);
    }
    (t0, t1)
}

/// Draws a vertical line per second.
fn seconds_grid(svg: &mut String, x: &impl Fn(u64) -> f64, t0: u64, t1: u64, height: f64) {
    let secs = (t1 - t0) / 1_000_000;
    for s in 0..=secs {
        let xx = x(t0 + s * 1_000_000);
        let _ = write!(
            svg,
            r##"<line x1="{xx}" y1="15" x2="{xx}" y2="{height}" stroke="#eee"/><text x="{xx}" y="12">{s}s</text>"##
        );
    }
}

/// Draws one row per fault kind, each fault an interval on it.
fn fault_layer(svg: &mut String, x: &impl Fn(u64) -> f64, nemesis: &[Value], fault_rows: &[&str], row_h: f64) {
    for (i, f) in fault_rows.iter().enumerate() {
        let y = 20.0 + row_h * i as f64;
        let _ = write!(svg, r#"<text x="2" y="{}">{}</text>"#, y + 10.0, esc(f));
        for n in nemesis.iter().filter(|n| n["fault"].as_str() == Some(f)) {
            let (a, b) = (n["start_us"].as_u64().unwrap_or(0), n["end_us"].as_u64().unwrap_or(0));
            let _ = write!(
                svg,
                r##"<rect x="{}" y="{y}" width="{}" height="{}" fill="#e55" opacity="0.7"><title>{} {}</title></rect>"##,
                x(a),
                (x(b) - x(a)).max(1.0),
                row_h - 2.0,
                esc(f),
                esc(n["target"].as_str().unwrap_or(""))
            );
        }
    }
}

/// Draws a dashed line per leader change.
fn leader_layer(svg: &mut String, x: &impl Fn(u64) -> f64, leaders: &[Value], t0: u64, height: f64) {
    for l in leaders {
        let xx = x(l["at_us"].as_u64().unwrap_or(t0));
        let _ = write!(
            svg,
            r##"<line x1="{xx}" y1="15" x2="{xx}" y2="{height}" stroke="#36c" stroke-dasharray="3,3"><title>leader: node {} (term {})</title></line>"##,
            l["node"], l["term"]
        );
    }
}

/// Draws a bar per request, colored by how it ended.
fn request_layer(svg: &mut String, x: &impl Fn(u64) -> f64, reqs: &[RequestRecord], top_req: f64, row_h: f64) {
    let _ = write!(svg, r#"<text x="2" y="{}">requests</text>"#, top_req - 2.0);
    for (i, r) in reqs.iter().enumerate() {
        let y = top_req + row_h * i as f64;
        let color = if !r.finished {
            "#c00"
        } else if r.connections > 1 {
            "#e90"
        } else {
            "#4a4"
        };
        let _ = write!(
            svg,
            r#"<rect x="{}" y="{y}" width="{}" height="{}" fill="{color}"><title>{} gen {}: {} events, {} connections{}</title></rect>"#,
            x(r.invoke_us),
            (x(r.complete_us) - x(r.invoke_us)).max(1.0),
            row_h - 3.0,
            esc(&r.request_id),
            r.generation,
            r.events.len(),
            r.connections,
            r.error
                .as_deref()
                .map(|e| format!(", last error {}", esc(e)))
                .unwrap_or_default()
        );
    }
}

/// Draws the acquires as dots on their generation's request row.
fn acquire_layer(
    svg: &mut String,
    x: &impl Fn(u64) -> f64,
    reqs: &[RequestRecord],
    decoder_ops: &[DecoderOp],
    top_req: f64,
    row_h: f64,
) {
    let row_of: BTreeMap<u64, usize> = reqs.iter().enumerate().map(|(i, r)| (r.generation, i)).collect();
    for o in decoder_ops
        .iter()
        .filter(|o| o.op() == "acquire" && o.ok() == Some(true))
    {
        let Some(&i) = row_of.get(&o.gen()) else {
            continue;
        };
        let epoch = o.epoch();
        let y = top_req + row_h * i as f64 + (row_h - 3.0) / 2.0;
        let fill = if epoch > 1 { "#000" } else { "#fff" };
        let _ = write!(
            svg,
            r##"<circle cx="{}" cy="{y}" r="3" fill="{fill}" stroke="#000"><title>epoch {epoch} to {}</title></circle>"##,
            x(o.complete_us.unwrap_or(0)),
            esc(&o.decoder)
        );
    }
}

/// Draws the append latency scatter, `lat_h` high, below `base`.
fn latency_layer(svg: &mut String, x: &impl Fn(u64) -> f64, decoder_ops: &[DecoderOp], base: f64, lat_h: f64) {
    let lats: Vec<(u64, f64)> = decoder_ops
        .iter()
        .filter(|o| o.op() == "append")
        .filter_map(|o| {
            let a = o.invoke_us;
            Some((a, (o.complete_us?.saturating_sub(a)) as f64 / 1000.0))
        })
        .collect();
    let max_ms = lats.iter().map(|l| l.1).fold(1.0, f64::max);
    let _ = write!(
        svg,
        r#"<text x="2" y="{}">append ms (max {max_ms:.0})</text>"#,
        base + 10.0
    );
    for (t, ms) in &lats {
        let y = base + lat_h - ms / max_ms * lat_h;
        let _ = write!(svg, r##"<circle cx="{}" cy="{y}" r="1.5" fill="#36c"/>"##, x(*t));
    }
}

/// The page around the SVG: the legend, and the verdicts below.
fn page(summary: &RunSummary, svg: &str) -> String {
    let verdicts = serde_json::to_string_pretty(summary).unwrap_or_default();
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>tokenlog run {seed}</title></head><body>\
         <h1>tokenlog fault run, seed {seed}: {result}</h1>\
         <p>red bars: faults (hover for the target) · dashed blue: leader changes · request bars: green clean, \
         orange resumed, red unfinished · dots: acquires (black = takeover, epoch &gt; 1) · bottom: append latency</p>\
         {svg}<h2>Verdicts</h2><pre>{v}</pre></body></html>",
        seed = summary.seed,
        result = if summary.ok { "all checks passed" } else { "VIOLATIONS" },
        v = esc(&verdicts)
    )
}
