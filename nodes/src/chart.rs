//! The hand-written SVG charts every bench and job draws with, one SVG path for all:
//! - [`LineChart`]: curves over an x range, values in `0..=1` on the y axis, optional vertical
//!   marks (events at an x) and a horizontal reference line (coadapt's accuracy and SLO plots);
//!   [`render_row`] puts several side by side.
//! - [`BarChart`]: horizontal bars on named rows, rows in titled groups stacked top to bottom, one
//!   x axis (the pipeline bench's Gantt chart of spans per worker, the coe bench's ratios).
//!
//! No plotting dependency: a few hundred bytes of SVG per curve or bar, readable in any browser.

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
    let mut body = String::new();
    for (i, c) in charts.iter().enumerate() {
        c.draw(&mut body, PANEL_W * i as f64);
    }
    document(w, PANEL_H, &body)
}

/// An SVG document of `w` x `h` on a white background around `body`.
fn document(w: f64, h: f64, body: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n{body}</svg>\n"
    )
}

/// One horizontal bar, from `start` to `end` on the x axis.
#[derive(Clone, Debug, PartialEq)]
pub struct Bar {
    /// Left end.
    pub start: f64,
    /// Right end.
    pub end: f64,
    /// Fill colour.
    pub fill: String,
    /// Text written after the bar's right end (may be empty).
    pub label: String,
    /// Tooltip (an SVG `<title>`; may be empty).
    pub tooltip: String,
}

/// A named row of bars (they may overlap, later ones on top).
#[derive(Clone, Debug, PartialEq)]
pub struct BarRow {
    /// Name at the row's left (may be empty).
    pub name: String,
    /// The bars.
    pub bars: Vec<Bar>,
}

/// Rows under a bold title (the title may be empty).
#[derive(Clone, Debug, PartialEq)]
pub struct BarGroup {
    /// Title above the rows.
    pub title: String,
    /// The rows, top to bottom.
    pub rows: Vec<BarRow>,
}

/// A bar chart (see the module doc): `LEFT` px of row names, then `BAR_W` px for the x range.
#[derive(Clone, Debug, PartialEq)]
pub struct BarChart {
    /// Title over the chart.
    pub title: String,
    /// Colour swatches with their meaning, in one line under the title.
    pub legend: Vec<(String, String)>,
    /// The x range drawn (left and right edges of the bars' area).
    pub x_range: (f64, f64),
    /// Tick positions and their labels, under the last group.
    pub x_ticks: Vec<(f64, String)>,
    /// The groups, top to bottom.
    pub groups: Vec<BarGroup>,
    /// Lines of text under the chart.
    pub notes: Vec<String>,
}

/// Width of a bar chart's row names.
const LEFT: f64 = 110.0;
/// Width of a bar chart's bar area.
const BAR_W: f64 = 900.0;
/// Height of one bar row.
const ROW_H: f64 = 22.0;

impl BarChart {
    /// The chart as an SVG document, `LEFT + BAR_W + 30` px wide, as tall as its rows need.
    pub fn render(&self) -> String {
        let (x0, x1) = self.x_range;
        let span = if x1 > x0 { x1 - x0 } else { 1.0 };
        let x = |v: f64| LEFT + BAR_W * (v - x0) / span;
        let mut s = String::new();
        let _ = writeln!(s, "<text x=\"10\" y=\"20\" font-size=\"14\">{}</text>", escape(&self.title));
        let mut y = 40.0;
        if !self.legend.is_empty() {
            let mut at = LEFT;
            for (fill, label) in &self.legend {
                let _ = writeln!(
                    s,
                    "<rect x=\"{at}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{fill}\"/><text x=\"{}\" y=\"{}\">{}</text>",
                    y - 10.0,
                    at + 16.0,
                    y + 1.0,
                    escape(label)
                );
                at += 40.0 + 7.0 * label.chars().count() as f64;
            }
            y += 12.0;
        }
        for g in &self.groups {
            if !g.title.is_empty() {
                let _ = writeln!(
                    s,
                    "<text x=\"10\" y=\"{}\" font-weight=\"bold\">{}</text>",
                    y + 14.0,
                    escape(&g.title)
                );
                y += 22.0;
            }
            for row in &g.rows {
                let _ = writeln!(s, "<text x=\"10\" y=\"{}\">{}</text>", y + 14.0, escape(&row.name));
                let _ = writeln!(
                    s,
                    "<line x1=\"{LEFT}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#ddd\"/>",
                    y + ROW_H,
                    LEFT + BAR_W,
                    y + ROW_H
                );
                for b in &row.bars {
                    let title = if b.tooltip.is_empty() {
                        String::new()
                    } else {
                        format!("<title>{}</title>", escape(&b.tooltip))
                    };
                    let _ = writeln!(
                        s,
                        "<rect x=\"{:.2}\" y=\"{:.2}\" width=\"{:.2}\" height=\"{:.2}\" fill=\"{}\" stroke=\"white\" stroke-width=\"0.3\">{title}</rect>",
                        x(b.start),
                        y + 3.0,
                        (x(b.end) - x(b.start)).max(0.5),
                        ROW_H - 6.0,
                        b.fill
                    );
                    if !b.label.is_empty() {
                        let _ = writeln!(
                            s,
                            "<text x=\"{:.1}\" y=\"{}\">{}</text>",
                            x(b.end) + 4.0,
                            y + 15.0,
                            escape(&b.label)
                        );
                    }
                }
                y += ROW_H;
            }
            y += 28.0;
        }
        for (at, label) in &self.x_ticks {
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{y:.1}\" text-anchor=\"middle\">{}</text>",
                x(*at),
                escape(label)
            );
        }
        if !self.x_ticks.is_empty() {
            y += 20.0;
        }
        for n in &self.notes {
            let _ = writeln!(s, "<text x=\"10\" y=\"{y:.1}\" fill=\"#555\">{}</text>", escape(n));
            y += 20.0;
        }
        document(LEFT + BAR_W + 30.0, y + 20.0, &s)
    }
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

    #[test]
    fn bars_land_where_the_axis_says_with_labels_tooltips_legend_and_notes() {
        let bar = |start: f64, end: f64, label: &str, tooltip: &str| Bar {
            start,
            end,
            fill: COLOURS[0].into(),
            label: label.into(),
            tooltip: tooltip.into(),
        };
        let chart = BarChart {
            title: "t".into(),
            legend: vec![(COLOURS[1].into(), "x & y".into())],
            x_range: (0.0, 2.0),
            x_ticks: vec![(1.0, "1 s".into())],
            groups: vec![
                BarGroup {
                    title: "run <a>".into(),
                    rows: vec![BarRow { name: "w0".into(), bars: vec![bar(1.0, 2.0, "", "i3 <s1>")] }],
                },
                BarGroup {
                    title: String::new(),
                    rows: vec![BarRow { name: "ours".into(), bars: vec![bar(0.0, 0.5, "0.50x", "")] }],
                },
            ],
            notes: vec!["a <note>".into()],
        };
        let svg = chart.render();
        assert_eq!(svg.matches("<rect ").count(), 1 + 1 + 2, "background, one swatch, two bars");
        // From x = 1 to 2 of a 0..2 axis: the right half of the 900 px bar area after 110 px of names.
        assert!(svg.contains("x=\"560.00\" y=\"77.00\" width=\"450.00\" height=\"16.00\""), "{svg}");
        assert!(svg.contains("<title>i3 &lt;s1&gt;</title>") && svg.contains(">0.50x</text>"), "{svg}");
        assert!(svg.contains("x &amp; y") && svg.contains("run &lt;a&gt;") && svg.contains("a &lt;note&gt;"));
        assert!(svg.contains("x=\"560.0\"") && svg.contains(">1 s</text>"), "the tick at x = 1");
        assert_eq!(svg.matches("font-weight=\"bold\"").count(), 1, "an empty group title is not drawn");
        assert!(
            svg.starts_with("<svg") && svg.contains("width=\"1040\"") && svg.trim_end().ends_with("</svg>")
        );
    }
}
