//! The report folder of a `chaos run` (CONTRACT § chaos): `report.json`, `report.md`,
//! `timeline.svg` and `history.jsonl` (every scenario's history, each line tagged with its
//! scenario), plus `scenarios/<name>/` with that scenario's own history and timeline, and
//! `logs/<name>/<replica>.log`.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::json;

use crate::history::{Event, Phase};
use crate::runner::ScenarioResult;

pub struct RunReport<'a> {
    pub run_id: &'a str,
    pub seed: u64,
    pub backend: &'a str,
    pub command: &'a str,
    pub results: &'a [ScenarioResult],
}

impl RunReport<'_> {
    pub fn json(&self) -> serde_json::Value {
        json!({
            "run_id": self.run_id,
            "seed": self.seed,
            "backend": self.backend,
            "reproduce": self.command,
            "scenarios": self.results.iter().map(|r| json!({
                "name": r.name,
                "amendment": r.amendment,
                "compat": r.compat,
                "seed": r.seed,
                // The backend that ran it (`auto` resolved).
                "backend": r.backend,
                "faults": r.faults,
                "invariants": r.invariants,
                "passed": r.passed,
                "inconclusive": r.inconclusive,
                "error": r.error,
                "duration_ms": r.duration_ms,
                "metrics": r.metrics,
            })).collect::<Vec<_>>(),
        })
    }

    /// The verdict table printed at the end of a run (also the head of `report.md`).
    pub fn table(&self) -> String {
        let mut rows = vec![["scenario", "amendment", "compat", "invariant", "expected", "observed", "verdict"].map(String::from)];
        for r in self.results {
            if let Some(e) = &r.error {
                rows.push([r.name.clone(), r.amendment.clone(), r.compat.clone(), "-".into(), "-".into(), "-".into(), format!("INCONCLUSIVE: {e}")]);
                continue;
            }
            for i in &r.invariants {
                let expected = match i.expected {
                    crate::scenario::Expect::Hold => "hold".to_owned(),
                    crate::scenario::Expect::Violate if i.cause.is_empty() => "violate".to_owned(),
                    crate::scenario::Expect::Violate => format!("violate by {}", i.cause.join(" + ")),
                };
                let mut observed = i.observed.clone().unwrap_or_else(|| "unknown".into());
                if i.cause_met == Some(false) {
                    observed.push_str(", not only by its cause");
                }
                let verdict = if i.met() {
                    if i.expected == crate::scenario::Expect::Violate { "ok (violated, as expected)".to_owned() } else { "ok".to_owned() }
                } else if i.observed.is_none() {
                    format!("INCONCLUSIVE: {}", i.error.clone().unwrap_or_default())
                } else {
                    "FAILED".to_owned()
                };
                let name = if i.listed { i.name.clone() } else { format!("{} (unlisted)", i.name) };
                rows.push([r.name.clone(), r.amendment.clone(), r.compat.clone(), name, expected, observed, verdict]);
            }
        }
        let widths: Vec<usize> = (0..7).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
        let mut out = String::new();
        for (n, row) in rows.iter().enumerate() {
            let line: Vec<String> = row.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
            out.push_str(line.join("  ").trim_end());
            out.push('\n');
            if n == 0 {
                out.push_str(&widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("  "));
                out.push('\n');
            }
        }
        out
    }

    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let passed = self.results.iter().filter(|r| r.passed).count();
        let _ = writeln!(md, "# chaos run {}\n", self.run_id);
        let _ = writeln!(md, "- seed: {} (reproduce: `{}`)", self.seed, self.command);
        let _ = writeln!(md, "- backend: {}", self.backend);
        let _ = writeln!(md, "- scenarios: {} met their expectations of {}\n", passed, self.results.len());
        let _ = writeln!(md, "```text\n{}```\n", self.table());
        let _ = writeln!(md, "![timeline](timeline.svg)\n");
        for r in self.results {
            let _ = writeln!(md, "## {} ({}, compat {})\n", r.name, r.amendment, r.compat);
            let _ = writeln!(md, "- {} in {:.1} s, seed {}", if r.passed { "met" } else if r.inconclusive { "inconclusive" } else { "NOT met" }, r.duration_ms as f64 / 1000.0, r.seed);
            if let Some(e) = &r.error {
                let _ = writeln!(md, "- error: {e}");
            }
            for f in &r.faults {
                let evidence = f.evidence.as_deref().map(|e| format!(" — {e}")).unwrap_or_default();
                let _ = writeln!(md, "- fault: {} {} at {} ms{evidence}", f.kind, f.target, f.at_ms);
            }
            for i in &r.invariants {
                let counts: Vec<String> = i.counts.iter().map(|(k, v)| format!("{k}={v}")).collect();
                let because = if i.cause.is_empty() { String::new() } else { format!(" by {}", i.cause.join(" + ")) };
                let _ = writeln!(md, "- **{}**: expected {:?}{because}, observed {} — {}", i.name, i.expected, i.observed.as_deref().unwrap_or("unknown"), counts.join(", "));
                if !i.culprits.is_empty() {
                    let who: Vec<String> = i.culprits.iter().map(|(k, v)| format!("{k} {v}")).collect();
                    let _ = writeln!(md, "  - {} violation(s), by culprit: {}", i.violations, who.join(", "));
                }
                for w in &i.witnesses {
                    let _ = writeln!(md, "  - {w}");
                }
            }
            if !r.metrics.is_empty() {
                let _ = writeln!(md, "\nMetrics at the end (each replica since its last start; zero series left out):\n");
                for (replica, series) in &r.metrics {
                    let shown: Vec<String> =
                        series.iter().filter(|(_, v)| **v != 0.0).map(|(k, v)| format!("{k}={v}")).collect();
                    let _ = writeln!(md, "- {replica}: {}", if shown.is_empty() { "all zero".into() } else { shown.join(", ") });
                }
            }
            let _ = writeln!(md);
        }
        md
    }

    /// JUnit XML: one `<testsuite>` per scenario, one `<testcase>` per invariant (a failure's
    /// text is its witnesses; an undecidable invariant or a run error is an `<error>`), so a
    /// CI server shows the verdicts natively.
    pub fn junit(&self) -> String {
        let mut cases = String::new();
        let (mut tests, mut failures, mut errors) = (0, 0, 0);
        for r in self.results {
            let secs = r.duration_ms as f64 / 1000.0;
            let mut body = String::new();
            let (mut t, mut f, mut e) = (0, 0, 0);
            if let Some(err) = &r.error {
                t += 1;
                e += 1;
                let _ = writeln!(body, r#"    <testcase classname="chaos.{0}" name="run" time="{secs:.3}"><error message="{1}">{1}</error></testcase>"#, xml(&r.name), xml(err));
            }
            for i in &r.invariants {
                t += 1;
                let expected = match i.expected {
                    crate::scenario::Expect::Hold => "held",
                    crate::scenario::Expect::Violate => "violated",
                };
                let name = format!("{} (expected {expected})", i.name);
                let _ = write!(body, r#"    <testcase classname="chaos.{}" name="{}" time="{secs:.3}">"#, xml(&r.name), xml(&name));
                match i.observed.as_deref() {
                    Some(_) if i.met() => {}
                    Some(o) => {
                        f += 1;
                        let o = if i.cause_met == Some(false) { format!("{o}, not only by its cause") } else { o.to_owned() };
                        let because = if i.cause.is_empty() { String::new() } else { format!(" by {}", i.cause.join(" + ")) };
                        let who: Vec<String> = i.culprits.iter().map(|(k, v)| format!("{k} {v}")).collect();
                        let by = if who.is_empty() { String::new() } else { format!("; culprits: {}", who.join(", ")) };
                        let msg = format!("expected {expected}{because}, observed {o}{by}");
                        let _ = write!(body, r#"<failure message="{}">{}</failure>"#, xml(&msg), xml(&i.witnesses.join("\n")));
                    }
                    None => {
                        e += 1;
                        let why = i.error.clone().unwrap_or_else(|| "inconclusive".into());
                        let _ = write!(body, r#"<error message="{0}">{0}</error>"#, xml(&why));
                    }
                }
                body.push_str("</testcase>\n");
            }
            let _ = writeln!(
                cases,
                r#"  <testsuite name="{}" tests="{t}" failures="{f}" errors="{e}" time="{secs:.3}">"#,
                xml(&r.name)
            );
            cases.push_str(&body);
            cases.push_str("  </testsuite>\n");
            tests += t;
            failures += f;
            errors += e;
        }
        format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"chaos run {}\" tests=\"{tests}\" failures=\"{failures}\" errors=\"{errors}\">\n{cases}</testsuites>\n",
            xml(self.run_id)
        )
    }

    /// Write every file of the report into `dir`.
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("report.json"), serde_json::to_string_pretty(&self.json()).expect("json"))?;
        std::fs::write(dir.join("report.md"), self.markdown())?;
        std::fs::write(dir.join("timeline.svg"), timeline(self.results))?;
        let mut all = String::new();
        for r in self.results {
            let sdir = crate::runner::scenario_dir(dir, &r.name);
            std::fs::create_dir_all(&sdir)?;
            std::fs::write(sdir.join("history.jsonl"), r.history.to_jsonl())?;
            std::fs::write(sdir.join("timeline.svg"), timeline(std::slice::from_ref(r)))?;
            for e in r.history.iter() {
                let mut v = serde_json::to_value(e).expect("entry");
                v["scenario"] = json!(r.name);
                all.push_str(&v.to_string());
                all.push('\n');
            }
        }
        std::fs::write(dir.join("history.jsonl"), all)
    }
}

/// Escape text for an XML attribute or element.
fn xml(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_control() || matches!(c, '\n' | '\t'))
        .map(|c| match c {
            '&' => "&amp;".to_owned(),
            '<' => "&lt;".to_owned(),
            '>' => "&gt;".to_owned(),
            '"' => "&quot;".to_owned(),
            '\n' => "&#10;".to_owned(),
            c => c.to_string(),
        })
        .collect()
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// One panel per scenario: effects/s (throughput), outbox depth and publish lag over
/// time, each scaled to its own maximum (printed in the legend), fault windows shaded.
pub fn timeline(results: &[ScenarioResult]) -> String {
    const W: f64 = 960.0;
    const PANEL: f64 = 170.0;
    const LEFT: f64 = 60.0;
    const RIGHT: f64 = 20.0;
    let height = 30.0 + PANEL * results.len().max(1) as f64;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="11">"##
    );
    let _ = writeln!(svg, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    let _ = writeln!(
        svg,
        r##"<text x="{LEFT}" y="18" font-size="13" font-weight="bold">chaos timeline — blue: effects/s, orange: outbox depth, green: publish lag; grey: fault windows</text>"##
    );
    for (n, r) in results.iter().enumerate() {
        let top = 30.0 + PANEL * n as f64;
        let plot_top = top + 22.0;
        let plot_h = PANEL - 50.0;
        let end_ms = r.history.iter().map(|e| e.t_ms).max().unwrap_or(1).max(1) as f64;
        let x = |t: f64| LEFT + (W - LEFT - RIGHT) * (t / end_ms);
        let verdict = if r.passed { "met" } else if r.inconclusive { "inconclusive" } else { "NOT met" };
        let _ = writeln!(
            svg,
            r##"<text x="{LEFT}" y="{:.1}" font-weight="bold">{} ({}, compat {}) — {verdict}</text>"##,
            top + 14.0,
            esc(&r.name),
            esc(&r.amendment),
            esc(&r.compat)
        );
        let _ = writeln!(svg, r##"<rect x="{LEFT}" y="{plot_top:.1}" width="{:.1}" height="{plot_h:.1}" fill="none" stroke="#999"/>"##, W - LEFT - RIGHT);
        // Fault windows.
        let mut open: Vec<(String, u64)> = Vec::new();
        let mut windows: Vec<(u64, u64, String)> = Vec::new();
        for e in r.history.iter() {
            match &e.event {
                Event::Fault { kind, target, phase: Phase::Start } => open.push((format!("{kind} {target}"), e.t_ms)),
                Event::Fault { kind, target, phase: Phase::End } => {
                    let key = format!("{kind} {target}");
                    let pos = open.iter().position(|(k, _)| *k == key).or_else(|| (!open.is_empty()).then_some(0));
                    if let Some(i) = pos {
                        let (label, start) = open.remove(i);
                        windows.push((start, e.t_ms, label));
                    }
                }
                Event::Crash { replica, how, .. } => windows.push((e.t_ms, e.t_ms, format!("{replica} {how}"))),
                _ => {}
            }
        }
        for (label, start) in open {
            windows.push((start, end_ms as u64, label));
        }
        for (i, (a, b, label)) in windows.iter().enumerate() {
            let (xa, xb) = (x(*a as f64), x(*b as f64).max(x(*a as f64) + 2.0));
            let _ = writeln!(
                svg,
                r##"<rect x="{xa:.1}" y="{plot_top:.1}" width="{:.1}" height="{plot_h:.1}" fill="#888" fill-opacity="0.22"><title>{}</title></rect>"##,
                xb - xa,
                esc(label)
            );
            let _ = writeln!(svg, r##"<text x="{:.1}" y="{:.1}" font-size="9" fill="#555">{}</text>"##, xa + 2.0, plot_top + 10.0 + 10.0 * (i % 3) as f64, esc(label));
        }
        // Series from samples.
        let samples: Vec<(f64, f64, f64, f64)> = r
            .history
            .iter()
            .filter_map(|e| match &e.event {
                Event::Sample { outbox_pending, effects, lag_ms, .. } => Some((e.t_ms as f64, *effects as f64, *outbox_pending as f64, *lag_ms)),
                _ => None,
            })
            .collect();
        let mut rate: Vec<(f64, f64)> = Vec::new();
        for w in samples.windows(2) {
            let dt = (w[1].0 - w[0].0) / 1000.0;
            if dt > 0.0 {
                rate.push((w[1].0, ((w[1].1 - w[0].1) / dt).max(0.0)));
            }
        }
        let depth: Vec<(f64, f64)> = samples.iter().map(|s| (s.0, s.2)).collect();
        let lag: Vec<(f64, f64)> = samples.iter().map(|s| (s.0, s.3)).collect();
        let mut legend = Vec::new();
        for (series, color, name, unit) in [(&rate, "#1f77b4", "effects/s", ""), (&depth, "#ff7f0e", "outbox depth", ""), (&lag, "#2ca02c", "publish lag", " ms")] {
            let max = series.iter().map(|p| p.1).fold(0.0f64, f64::max);
            legend.push(format!("{name} max {max:.0}{unit}"));
            if series.is_empty() {
                continue;
            }
            let scale = if max > 0.0 { max } else { 1.0 };
            let pts: Vec<String> = series.iter().map(|(t, v)| format!("{:.1},{:.1}", x(*t), plot_top + plot_h - plot_h * (v / scale))).collect();
            let _ = writeln!(svg, r##"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"##, pts.join(" "));
        }
        let _ = writeln!(svg, r##"<text x="{LEFT}" y="{:.1}" fill="#333">0 s</text>"##, plot_top + plot_h + 14.0);
        let _ = writeln!(svg, r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#333">{:.1} s</text>"##, W - RIGHT, plot_top + plot_h + 14.0, end_ms / 1000.0);
        let _ = writeln!(svg, r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#333">{}</text>"##, (W + LEFT) / 2.0, plot_top + plot_h + 14.0, esc(&legend.join("  ·  ")));
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::runner::InvariantResult;
    use crate::scenario::Expect;

    fn invariant(name: &str, expected: Expect, observed: Option<&str>, witnesses: &[&str]) -> InvariantResult {
        InvariantResult {
            name: name.into(),
            expected,
            observed: observed.map(str::to_owned),
            counts: BTreeMap::new(),
            witnesses: witnesses.iter().map(|w| w.to_string()).collect(),
            cause: vec![],
            cause_met: None,
            violations: 0,
            culprits: BTreeMap::new(),
            error: observed.is_none().then(|| "nothing to check".into()),
            listed: true,
        }
    }

    #[test]
    fn junit_has_a_case_per_invariant_with_witnesses_as_failure_text() {
        let r = ScenarioResult {
            name: "broker-kill".into(),
            amendment: "#1128".into(),
            compat: "-".into(),
            seed: 1,
            backend: "local".into(),
            faults: vec![],
            invariants: vec![
                invariant("no_loss", Expect::Hold, Some("violated"), &["referral <a&b> lost"]),
                invariant("effect_once", Expect::Violate, Some("violated"), &[]),
                invariant("liveness", Expect::Hold, None, &[]),
            ],
            passed: false,
            inconclusive: true,
            duration_ms: 1500,
            error: None,
            metrics: BTreeMap::new(),
            history: Default::default(),
        };
        let results = [r];
        let rep = RunReport { run_id: "r1", seed: 1, backend: "local", command: "chaos run", results: &results };
        let x = rep.junit();
        assert!(x.contains(r#"<testsuites name="chaos run r1" tests="3" failures="1" errors="1">"#), "{x}");
        assert!(x.contains(r#"name="no_loss (expected held)" time="1.500"><failure message="expected held, observed violated">referral &lt;a&amp;b&gt; lost</failure>"#), "{x}");
        assert!(x.contains(r#"name="effect_once (expected violated)" time="1.500"></testcase>"#), "{x}");
        assert!(x.contains(r#"<error message="nothing to check">"#), "{x}");
    }
}
