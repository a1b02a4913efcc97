//! The hand-written SVG line chart the benches and jobs share: curves over an x range, values in
//! `0..=1` on the y axis, optional vertical marks (events at an x) and a horizontal reference
//! line. No plotting dependency: a few hundred bytes of SVG per curve, readable in any browser.

use std::fmt::Write;

/// Curve colours, in order (cycled).
pub const COLOURS: [&str; 6] = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];

/// One curve.
#[derive(Clone, Debug, PartialEq)]
pub struct Curve {
    /// Legend name.
    pub name: String,
    /// `(x, y)` points, drawn in order; y is clamped to `0..=1`.
    pub points: Vec<(f64, f64)>,
}

/// A vertical mark at `x` (a drift phase starting, an adaptation installed), drawn in its
/// curve's colour (or grey) with a short label at the top.
#[derive(Clone, Debug, PartialEq)]
pub struct Mark {
    /// Where.
    pub x: f64,
    /// The curve it belongs to (its colour), if any.
    pub curve: Option<usize>,
    /// Dashed (e.g. drift) or solid (e.g. adaptation).
    pub dashed: bool,
    /// A short label (may be empty).
    pub label: String,
}

/// A line chart (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct LineChart {
    /// Title over the plot.
    pub title: String,
    /// Label under the x axis.
    pub x_label: String,
    /// The x range drawn (left and right edges).
    pub x_range: (f64, f64),
    /// Tick positions and their labels on the x axis.
    pub x_ticks: Vec<(f64, String)>,
    /// A dashed horizontal reference line at this y (e.g. an SLO).
    pub reference: Option<f64>,
    /// The curves.
    pub curves: Vec<Curve>,
    /// Vertical marks.
    pub marks: Vec<Mark>,
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

impl LineChart {
    /// The chart as an SVG document (720 x 420, plot area 600 x 320 at (60, 40)).
    pub fn render(&self) -> String {
        render_row(std::slice::from_ref(self))
    }

    /// Draws the chart into `s` as a 720 x 420 panel whose left edge is at `offset`.
    fn draw(&self, s: &mut String, offset: f64) {
        let (h, left, top, pw, ph) = (PANEL_H, offset + 60.0, 40.0, 600.0, 320.0);
        let (x0, x1) = self.x_range;
        let span = if x1 > x0 { x1 - x0 } else { 1.0 };
        let x = |v: f64| left + pw * (v - x0) / span;
        let y = |v: f64| top + ph * (1.0 - v.clamp(0.0, 1.0));
        let _ = writeln!(s, "<text x=\"{left}\" y=\"22\" font-size=\"14\">{}</text>", escape(&self.title));
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
        for (at, label) in &self.x_ticks {
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
                x(*at),
                top + ph + 18.0,
                escape(label)
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            left + pw / 2.0,
            h - 8.0,
            escape(&self.x_label)
        );
        if let Some(r) = self.reference {
            let _ = writeln!(
                s,
                "<line x1=\"{left}\" y1=\"{:.1}\" x2=\"{}\" y2=\"{:.1}\" stroke=\"#999\" stroke-dasharray=\"4 3\"/>",
                y(r),
                left + pw,
                y(r)
            );
        }
        for m in &self.marks {
            let c = m.curve.map_or("#777", |k| COLOURS[k % COLOURS.len()]);
            let dash = if m.dashed { " stroke-dasharray=\"3 3\"" } else { "" };
            let _ = writeln!(
                s,
                "<line x1=\"{:.1}\" y1=\"{top}\" x2=\"{:.1}\" y2=\"{}\" stroke=\"{c}\" stroke-width=\"1\"{dash}/>",
                x(m.x),
                x(m.x),
                top + ph
            );
            if !m.label.is_empty() {
                // one label row per curve and kind of mark, so neighbours rarely overprint
                let row = (2 * m.curve.unwrap_or(0) + usize::from(m.dashed)) % 8;
                let _ = writeln!(
                    s,
                    "<text x=\"{:.1}\" y=\"{}\" fill=\"{c}\" font-size=\"10\">{}</text>",
                    x(m.x) + 2.0,
                    top + 10.0 + 11.0 * row as f64,
                    escape(&m.label)
                );
            }
        }
        for (i, curve) in self.curves.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            let pts: Vec<String> =
                curve.points.iter().map(|(a, b)| format!("{:.1},{:.1}", x(*a), y(*b))).collect();
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
                escape(&curve.name)
            );
        }
    }
}

/// Width of one chart panel.
const PANEL_W: f64 = 720.0;
/// Height of a chart panel.
const PANEL_H: f64 = 420.0;

/// Charts side by side in one SVG document (each a 720 x 420 panel, left to right).
pub fn render_row(charts: &[LineChart]) -> String {
    let w = PANEL_W * charts.len().max(1) as f64;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{PANEL_H}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"{w}\" height=\"{PANEL_H}\" fill=\"white\"/>\n"
    );
    for (i, c) in charts.iter().enumerate() {
        c.draw(&mut s, PANEL_W * i as f64);
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_and_marks_land_where_the_axes_say() {
        let chart = LineChart {
            title: "a < b".into(),
            x_label: "frame".into(),
            x_range: (0.0, 100.0),
            x_ticks: vec![(50.0, "50".into())],
            reference: None,
            curves: vec![Curve { name: "cam".into(), points: vec![(0.0, 1.0), (100.0, 0.5)] }],
            marks: vec![Mark { x: 25.0, curve: Some(0), dashed: true, label: "fog".into() }],
        };
        let svg = chart.render();
        assert!(svg.contains("points=\"60.0,40.0 660.0,200.0\""), "{svg}");
        assert!(svg.contains("x1=\"210.0\" y1=\"40\" x2=\"210.0\" y2=\"360\" stroke=\"#d62728\""), "{svg}");
        assert!(svg.contains("a &lt; b"), "titles are escaped");
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
