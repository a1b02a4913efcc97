//! The bench's SVG: SLO attainment against K, one panel per source (measured, simulated) side by
//! side, one polyline per strategy.

use std::fmt::Write as _;

use super::SLO_RATIO;

/// One chart: curves of (K, SLO attainment) points.
pub struct Panel<'a> {
    /// Title above the chart.
    pub title: &'a str,
    /// Largest K on the axis.
    pub k_max: usize,
    /// (strategy, points).
    pub curves: Vec<(&'a str, Vec<(usize, f64)>)>,
}

const PANEL_W: f64 = 720.0;
const H: f64 = 420.0;

/// The panels side by side in one SVG.
pub fn render_svg(panels: &[Panel<'_>]) -> String {
    let w = PANEL_W * panels.len().max(1) as f64;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"{w}\" height=\"{H}\" fill=\"white\"/>\n"
    );
    for (i, p) in panels.iter().enumerate() {
        panel(&mut s, PANEL_W * i as f64, p);
    }
    s.push_str("</svg>\n");
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn panel(s: &mut String, x0: f64, p: &Panel<'_>) {
    let (left, top, pw, ph) = (x0 + 60.0, 40.0, 600.0, 320.0);
    let colours = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];
    let k_max = p.k_max.max(2);
    let x = |k: usize| left + pw * (k as f64 - 1.0) / (k_max as f64 - 1.0);
    let y = |v: f64| top + ph * (1.0 - v.clamp(0.0, 1.0));
    let _ = writeln!(s, "<text x=\"{left}\" y=\"22\" font-size=\"14\">{}</text>", escape(p.title));
    let _ = writeln!(
        s,
        "<line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{}\" stroke=\"black\"/>",
        top + ph,
        left + pw,
        top + ph,
        top + ph
    );
    for t in 0..=5 {
        let v = t as f64 / 5.0;
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.1}</text>\n<line x1=\"{left}\" y1=\"{:.1}\" x2=\"{}\" y2=\"{:.1}\" stroke=\"#ddd\"/>",
            left - 6.0,
            y(v) + 4.0,
            y(v),
            left + pw,
            y(v)
        );
    }
    let step = (k_max / 8).max(1);
    for k in (1..=k_max).step_by(step) {
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{k}</text>",
            x(k),
            top + ph + 18.0
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">K (concurrent tasks)</text>\n<line x1=\"{left}\" y1=\"{:.1}\" x2=\"{}\" y2=\"{:.1}\" stroke=\"#999\" stroke-dasharray=\"4 3\"/>",
        left + pw / 2.0,
        H - 8.0,
        y(SLO_RATIO),
        left + pw,
        y(SLO_RATIO)
    );
    for (i, (name, pts)) in p.curves.iter().enumerate() {
        let c = colours[i % colours.len()];
        let pts: Vec<String> = pts.iter().map(|(k, v)| format!("{:.1},{:.1}", x(*k), y(*v))).collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            pts.join(" ")
        );
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{}</text>",
            left + pw - 90.0,
            top + 16.0 + 16.0 * i as f64,
            escape(name)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_has_one_polyline_per_curve_and_panels_side_by_side() {
        let measured = Panel { title: "measured", k_max: 4, curves: vec![("a", vec![(1, 1.0), (4, 0.5)])] };
        let sim = Panel {
            title: "sim",
            k_max: 2,
            curves: vec![("a", vec![(1, 1.0), (2, 0.5)]), ("b", vec![(1, 0.0), (2, 0.0)])],
        };
        let svg = render_svg(&[measured, sim]);
        assert_eq!(svg.matches("<polyline").count(), 3);
        // K = 1 at each panel's left edge, attainment 1.0 at the top; the second panel starts 720 px on.
        assert!(svg.contains("points=\"60.0,40.0 660.0,200.0\""), "{svg}");
        assert!(svg.contains("points=\"780.0,40.0 1380.0,200.0\""), "{svg}");
        assert!(svg.contains("width=\"1440\""));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
