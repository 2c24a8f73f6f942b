//! SVG line charts written by hand (no fonts or system libraries needed):
//! throughput and latency percentiles against the offered load, one colour
//! per configuration, solid p50 and dashed p99, for README/BENCHMARKS
//! embedding. Text uses the viewer's sans-serif font.

use crate::load::Shape;
use crate::report::{Results, RunReport};
use crate::stats::Summary;

/// One line of a chart.
pub struct Series {
    pub name: String,
    pub color: usize,
    pub dashed: bool,
    pub points: Vec<(f64, f64)>,
}

/// A chart: title, axis labels and its lines.
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];
const W: f64 = 720.0;
const H: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 210.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 55.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A step of 1, 2 or 5 times a power of ten giving about `n` ticks over
/// `0..=max`.
fn nice_step(max: f64, n: f64) -> f64 {
    let raw = (max / n).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

fn fmt_tick(v: f64) -> String {
    if v.fract() == 0.0 || v.abs() >= 10.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .into()
    }
}

impl Chart {
    /// The chart as a standalone SVG document. Axes start at 0; x ticks sit
    /// at the measured loads.
    pub fn render(&self) -> String {
        let pts = self.series.iter().flat_map(|s| s.points.iter());
        let (mut xmax, mut ymax) = (0f64, 0f64);
        let mut xs: Vec<f64> = Vec::new();
        for &(x, y) in pts {
            xmax = xmax.max(x);
            ymax = ymax.max(y);
            if !xs.contains(&x) {
                xs.push(x);
            }
        }
        xs.sort_by(|a, b| a.total_cmp(b));
        let xmax = if xmax > 0.0 { xmax } else { 1.0 };
        let ystep = nice_step(if ymax > 0.0 { ymax } else { 1.0 }, 5.0);
        let ytop = (ymax / ystep).ceil().max(1.0) * ystep;
        let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
        let px = |x: f64| LEFT + x / xmax * pw;
        let py = |y: f64| TOP + ph - y / ytop * ph;
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" \
             viewBox=\"0 0 {W} {H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
             <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
            LEFT + pw / 2.0,
            esc(&self.title)
        );
        let mut y = 0.0;
        while y <= ytop + ystep * 1e-9 {
            let yy = py(y);
            s += &format!(
                "<line x1=\"{LEFT}\" y1=\"{yy:.1}\" x2=\"{:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/>\n\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
                LEFT + pw,
                LEFT - 6.0,
                yy + 4.0,
                fmt_tick(y)
            );
            y += ystep;
        }
        for &x in &xs {
            let xx = px(x);
            s += &format!(
                "<line x1=\"{xx:.1}\" y1=\"{:.1}\" x2=\"{xx:.1}\" y2=\"{:.1}\" stroke=\"#333\"/>\n\
                 <text x=\"{xx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
                TOP + ph,
                TOP + ph + 5.0,
                TOP + ph + 19.0,
                fmt_tick(x)
            );
        }
        s += &format!(
            "<polyline points=\"{LEFT},{TOP} {LEFT},{b} {r},{b}\" fill=\"none\" stroke=\"#333\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n\
             <text transform=\"translate(18 {:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
            LEFT + pw / 2.0,
            H - 12.0,
            esc(&self.x_label),
            TOP + ph / 2.0,
            esc(&self.y_label),
            b = TOP + ph,
            r = LEFT + pw,
        );
        for (i, se) in self.series.iter().enumerate() {
            let c = PALETTE[se.color % PALETTE.len()];
            let dash = if se.dashed {
                " stroke-dasharray=\"6 4\""
            } else {
                ""
            };
            let p: Vec<String> = se
                .points
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            s += &format!(
                "<polyline points=\"{}\" fill=\"none\" stroke=\"{c}\" stroke-width=\"2\"{dash}/>\n",
                p.join(" ")
            );
            for &(x, y) in &se.points {
                s += &format!(
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{c}\"/>\n",
                    px(x),
                    py(y)
                );
            }
            let ly = TOP + 10.0 + i as f64 * 18.0;
            let lx = W - RIGHT + 15.0;
            s += &format!(
                "<line x1=\"{lx}\" y1=\"{ly}\" x2=\"{:.1}\" y2=\"{ly}\" stroke=\"{c}\" stroke-width=\"2\"{dash}/>\n\
                 <text x=\"{:.1}\" y=\"{:.1}\">{}</text>\n",
                lx + 24.0,
                lx + 30.0,
                ly + 4.0,
                esc(&se.name)
            );
        }
        s + "</svg>\n"
    }
}

fn x_label(all: &[Results]) -> &'static str {
    match all
        .iter()
        .flat_map(|r| r.runs.first())
        .next()
        .map(|r| r.shape)
    {
        Some(Shape::Rate(_)) => "offered load (requests/s, Poisson)",
        _ => "concurrent requests",
    }
}

fn lines(
    all: &[Results],
    name: &str,
    dashed: bool,
    f: impl Fn(&RunReport) -> Option<f64>,
) -> Vec<Series> {
    all.iter()
        .enumerate()
        .map(|(i, res)| Series {
            name: if name.is_empty() {
                res.label.clone()
            } else {
                format!("{} {name}", res.label)
            },
            color: i,
            dashed,
            points: res
                .runs
                .iter()
                .filter_map(|r| Some((r.shape.value(), f(r)?)))
                .collect(),
        })
        .collect()
}

fn percentile_chart(
    all: &[Results],
    title: &str,
    unit: &str,
    scale: f64,
    f: fn(&RunReport) -> &Summary,
) -> Chart {
    let mut series = lines(all, "p50", false, |r| f(r).p50.map(|v| v * scale));
    series.extend(lines(all, "p99", true, |r| f(r).p99.map(|v| v * scale)));
    Chart {
        title: title.into(),
        x_label: x_label(all).into(),
        y_label: unit.into(),
        series,
    }
}

/// The charts comparing the configurations of `all`, by file name.
pub fn charts(all: &[Results]) -> Vec<(&'static str, Chart)> {
    let xl = x_label(all);
    vec![
        (
            "throughput.svg",
            Chart {
                title: "Output throughput".into(),
                x_label: xl.into(),
                y_label: "output tokens/s".into(),
                series: lines(all, "", false, |r| Some(r.output_throughput)),
            },
        ),
        (
            "requests.svg",
            Chart {
                title: "Completed requests per second".into(),
                x_label: xl.into(),
                y_label: "requests/s".into(),
                series: lines(all, "", false, |r| Some(r.request_throughput)),
            },
        ),
        (
            "ttft.svg",
            percentile_chart(
                all,
                "Time to first token (p50 solid, p99 dashed)",
                "ms",
                1e3,
                |r| &r.ttft,
            ),
        ),
        (
            "itl.svg",
            percentile_chart(
                all,
                "Inter-token latency (p50 solid, p99 dashed)",
                "ms",
                1e3,
                |r| &r.itl,
            ),
        ),
        (
            "e2e.svg",
            percentile_chart(
                all,
                "End-to-end latency (p50 solid, p99 dashed)",
                "s",
                1.0,
                |r| &r.e2e,
            ),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_and_document_shape() {
        assert_eq!(nice_step(100.0, 5.0), 20.0);
        assert_eq!(nice_step(7.0, 5.0), 2.0);
        assert!((nice_step(0.3, 5.0) - 0.1).abs() < 1e-12);
        let c = Chart {
            title: "a < b".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series: vec![Series {
                name: "off".into(),
                color: 0,
                dashed: true,
                points: vec![(1.0, 10.0), (4.0, 30.0), (8.0, 35.0)],
            }],
        };
        let s = c.render();
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert!(s.contains("a &lt; b") && s.contains("stroke-dasharray"));
        assert_eq!(s.matches("<circle").count(), 3);
        // The highest point sits on the top gridline (ymax 35 -> ticks to 40).
        assert!(s.contains(">40</text>"));
        // Balanced tags: every opened element is closed or self-closing.
        assert_eq!(s.matches("<text").count(), s.matches("</text>").count());
    }
}
