//! A storm at scale: 10 000 callers in 100 client processes and a fleet of
//! 100 instances, on tokio's paused clock, through each scenario's short
//! trigger, for every column (tower's retry with and without its budget,
//! the stack over tower's balancer, over a fleet, throttled, limited per
//! instance; each against a plain server, one that honours deadlines, and
//! one that also sheds).
//! See the `sim` module of this package for the model and its limits.
//!
//! `cargo bench -p tower-resend-benches --bench storm` prints a table per
//! scenario and writes `docs/storm.svg` at the workspace root. Narrowed
//! with `STORM_SCENARIOS`, `STORM_CLIENTS`, `STORM_SERVERS` (names,
//! comma-separated), `STORM_SCALE=small` (1 000 callers, 10 instances),
//! `STORM_SEED` (default 1), `STORM_SECONDS=1` (every second of every run);
//! `docs/storm.svg` is drawn only from a full run, and `STORM_SVG=path`
//! draws the picture of whatever ran there.

#![allow(clippy::print_stdout)] // a bench reports on standard output

use std::path::PathBuf;

use plotters::prelude::*;
use tower_resend_benches::sim::{
    self, Client, Column, Model, Plan, Report, Scale, Scenario, Server,
};

/// The names in `var` (comma-separated) as `parse` reads them, or `all`.
fn chosen<T: Copy>(var: &str, all: &[T], parse: fn(&str) -> Option<T>) -> Vec<T> {
    match std::env::var(var) {
        Ok(list) if !list.trim().is_empty() => list
            .split(',')
            .map(|n| parse(n.trim()).unwrap_or_else(|| panic!("{var}: no such name: {n}")))
            .collect(),
        _ => all.to_vec(),
    }
}

fn main() {
    let scenarios = chosen("STORM_SCENARIOS", &Scenario::ALL, Scenario::from_name);
    let clients = chosen("STORM_CLIENTS", &Client::ALL, Client::from_name);
    let servers = chosen("STORM_SERVERS", &Server::ALL, Server::from_name);
    let small = std::env::var("STORM_SCALE").is_ok_and(|s| s == "small");
    let scale = if small { Scale::SMALL } else { Scale::FULL };
    let seed = std::env::var("STORM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let every_second = std::env::var("STORM_SECONDS").is_ok_and(|s| s == "1");
    let model = Model::default();
    println!(
        "{} callers in {} client processes, {} instances ({} workers, queue {}, work {:?} mean), \
         load {:.0} % of {:.0} calls/s; {} attempts, {:?} each, {:?} a call; seed {seed}",
        scale.callers,
        scale.clients,
        scale.instances,
        model.workers,
        model.queue,
        model.work_mean,
        model.load * 100.0,
        model.capacity(scale),
        model.attempts,
        model.attempt_timeout,
        model.total,
    );
    let columns: Vec<Column> = servers
        .iter()
        .flat_map(|&server| clients.iter().map(move |&client| Column { client, server }))
        .collect();
    let mut runs = Vec::new();
    for &scenario in &scenarios {
        println!();
        println!(
            "### {} (trigger {} s to {} s; watched {} s after)",
            scenario.name(),
            model.warm_up.as_secs(),
            (model.warm_up + scenario.length()).as_secs(),
            model.watch.as_secs(),
        );
        println!();
        println!(
            "| client | server | recovered | goodput | peak ampl. | peak load | ampl. | p99 before, at the end \
             | work for gone callers | queued, dropped | 503, queue full | shed | wall |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for &column in &columns {
            let plan = Plan {
                scenario,
                column,
                scale,
                model,
                seed,
            };
            // (Outside the paused runtime, tokio's clock is the real one.)
            let began = tokio::time::Instant::now();
            let report = sim::run(&plan);
            let wall = began.elapsed();
            let f = &report.figures;
            println!(
                "| {} | {} | {} | {:.0} % | {:.2}x | {:.2}x | {:.2}x | {} ms, {} ms | {:.0} % | {} | {} | {} | {:.1} s |",
                column.client.name(),
                column.server.name(),
                f.recovery,
                f.goodput_share * 100.0,
                f.peak_amplification,
                f.peak_load,
                f.amplification,
                f.p99_before.as_millis(),
                f.p99_end.as_millis(),
                f.wasted_share * 100.0,
                f.dropped,
                f.full,
                f.shed,
                wall.as_secs_f64(),
            );
            if every_second {
                print_seconds(&report);
            }
            runs.push((plan, report));
        }
    }
    summary(&scenarios, &columns, &runs);
    let complete = scenarios.len() == Scenario::ALL.len()
        && clients.len() == Client::ALL.len()
        && servers.len() == Server::ALL.len();
    let path = match std::env::var("STORM_SVG") {
        Ok(path) => Some(PathBuf::from(path)),
        Err(_) if complete && !small => {
            Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/storm.svg"))
        }
        Err(_) => None,
    };
    if let Some(path) = path {
        draw(&runs, scale, &path).expect("the SVG is written");
        println!("wrote {}", path.display());
    }
}

/// One line a column: when it recovered in each scenario, with its peak
/// amplification.
fn summary(scenarios: &[Scenario], columns: &[Column], runs: &[(Plan, Report)]) {
    println!();
    println!(
        "### recovered after the trigger's end (in one second at most: attempts per call made, \
         and those of them that reached an instance)"
    );
    println!();
    let names: Vec<&str> = scenarios.iter().map(|s| s.name()).collect();
    println!("| client | server | {} |", names.join(" | "));
    println!("|---|---|{}", "---|".repeat(scenarios.len()));
    for column in columns {
        let cells: Vec<String> = scenarios
            .iter()
            .map(|&scenario| {
                runs.iter()
                    .find(|(p, _)| p.scenario == scenario && p.column == *column)
                    .map_or(String::new(), |(_, r)| {
                        let f = &r.figures;
                        format!(
                            "{} ({:.1}x, {:.1}x)",
                            f.recovery, f.peak_amplification, f.peak_load
                        )
                    })
            })
            .collect();
        println!(
            "| {} | {} | {} |",
            column.client.name(),
            column.server.name(),
            cells.join(" | ")
        );
    }
}

fn print_seconds(report: &Report) {
    println!("second offered sent reached good p99 work wasted");
    for (i, s) in report.seconds.iter().enumerate() {
        println!(
            "{i} {} {} {} {} {:?} {:.1} {:.1}",
            s.offered, s.sent, s.reached, s.good, s.p99, s.work, s.wasted
        );
    }
}

/// `n` with its thousands apart: 10 000.
fn grouped(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, d) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(d);
    }
    out
}

/// The dashed line of each panel, beside every client against the plain
/// server: the fleet stack with the server half in front.
const FULL_SYSTEM: Column = Column {
    client: Client::StackFleet,
    server: Server::Shed,
};

fn colour(client: Client) -> RGBColor {
    match client {
        Client::TowerRetry => RGBColor(200, 40, 40),
        Client::TowerBudget => RGBColor(230, 140, 20),
        Client::Stack => RGBColor(130, 130, 130),
        Client::StackFleet => RGBColor(0, 110, 190),
        Client::StackThrottled => RGBColor(40, 160, 90),
        Client::StackLimited => RGBColor(120, 60, 170),
        Client::StackTotal => RGBColor(0, 170, 200),
    }
}

/// Goodput over simulated time (each second's calls answered 2xx within
/// their deadline, per call made, as a share of the same before the
/// trigger), a panel per scenario, a line per client against the plain
/// server and a dashed one for the fleet stack with the server half; the
/// trigger shaded; each line's recovery in the legend.
fn draw(
    runs: &[(Plan, Report)],
    scale: Scale,
    path: &PathBuf,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut scenarios: Vec<Scenario> = Vec::new();
    for (p, _) in runs {
        if !scenarios.contains(&p.scenario) {
            scenarios.push(p.scenario);
        }
    }
    let root = SVGBackend::new(path, (980, 40 + 240 * scenarios.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, panels) = root.split_vertically(40);
    title.draw(&Text::new(
        format!(
            "Goodput through a short trigger, % of before it: {} callers, {} instances, load 70 %",
            grouped(scale.callers),
            scale.instances
        ),
        (12, 12),
        ("sans-serif", 18).into_font(),
    ))?;
    let font = ("sans-serif", 12).into_font();
    for (panel, scenario) in panels
        .split_evenly((scenarios.len(), 1))
        .iter()
        .zip(&scenarios)
    {
        let (plot, legend) = panel.split_horizontally(720);
        let lines: Vec<&(Plan, Report)> = runs
            .iter()
            .filter(|(p, _)| {
                p.scenario == *scenario
                    && (p.column.server == Server::Plain || p.column == FULL_SYSTEM)
            })
            .collect();
        let Some((_, first)) = lines.first() else {
            continue;
        };
        let end = first.seconds.len() as f64;
        let (from, to) = first.trigger;
        let mut chart = ChartBuilder::on(&plot)
            .caption(
                format!(
                    "{}: trigger {} s to {} s (shaded)",
                    scenario.name(),
                    from.as_secs(),
                    to.as_secs()
                ),
                ("sans-serif", 15),
            )
            .margin(6)
            .x_label_area_size(22)
            .y_label_area_size(44)
            .build_cartesian_2d(0f64..end, 0f64..130f64)?;
        chart
            .configure_mesh()
            .y_desc("goodput %")
            .x_labels(16)
            .y_labels(6)
            .light_line_style(WHITE.mix(0.0))
            .draw()?;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(from.as_secs_f64(), 0.0), (to.as_secs_f64(), 130.0)],
            RGBColor(240, 200, 200).mix(0.35).filled(),
        )))?;
        legend.draw(&Text::new(
            "recovered after the trigger",
            (4, 30),
            font.clone(),
        ))?;
        for (row, (plan, report)) in lines.iter().enumerate() {
            let column = plan.column;
            let before = report.figures.baseline_share.max(1e-9);
            let points: Vec<(f64, f64)> = report
                .seconds
                .iter()
                .enumerate()
                .map(|(s, x)| (s as f64 + 0.5, (100.0 * x.good_share() / before).min(130.0)))
                .collect();
            let (style, dashed) = if column == FULL_SYSTEM {
                (BLACK.stroke_width(2), true)
            } else {
                (colour(column.client).stroke_width(2), false)
            };
            if dashed {
                chart.draw_series(DashedLineSeries::new(points, 6, 4, style))?;
            } else {
                chart.draw_series(LineSeries::new(points, style))?;
            }
            let y = 52 + 22 * row as i32;
            legend.draw(&PathElement::new([(4, y), (24, y)], style))?;
            let label = format!("{}: {}", column.name(), report.figures.recovery);
            legend.draw(&Text::new(label, (30, y - 6), font.clone()))?;
        }
    }
    root.present()?;
    Ok(())
}
