//! The figures of a run: per second of simulated time, and for the run.

use std::fmt;
use std::time::Duration;

use super::Plan;

/// Seconds in a row at 95 % of the goodput before the trigger that count
/// as recovered (one good second in a storm is not a recovery).
pub(crate) const HOLD: usize = 3;

/// The share of the goodput before the trigger that counts as recovered.
pub const RECOVERED: f64 = 0.95;

/// Counts per second.
#[derive(Debug, Default)]
pub(crate) struct Counter(Vec<u32>);

impl Counter {
    pub(crate) fn bump(&mut self, second: usize) {
        if let Some(n) = self.0.get_mut(second) {
            *n += 1;
        }
    }
}

/// What a run counted, per second.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) offered: Counter,
    pub(crate) sent: Counter,
    pub(crate) reached: Counter,
    good: Counter,
    /// Every call's time, in microseconds, by the second it ended in.
    latencies: Vec<Vec<u32>>,
    /// Instance work finished, in seconds of work.
    work: Vec<f64>,
    /// The part of it whose caller had gone.
    wasted: Vec<f64>,
    pub(crate) dropped: u64,
    pub(crate) full: u64,
    pub(crate) shed: u64,
}

impl Tally {
    pub(crate) fn new(seconds: usize) -> Self {
        Self {
            offered: Counter(vec![0; seconds]),
            sent: Counter(vec![0; seconds]),
            reached: Counter(vec![0; seconds]),
            good: Counter(vec![0; seconds]),
            latencies: vec![Vec::new(); seconds],
            work: vec![0.0; seconds],
            wasted: vec![0.0; seconds],
            dropped: 0,
            full: 0,
            shed: 0,
        }
    }

    pub(crate) fn ended(&mut self, second: usize, took: Duration, good: bool) {
        if good {
            self.good.bump(second);
        }
        if let Some(l) = self.latencies.get_mut(second) {
            l.push(u32::try_from(took.as_micros()).unwrap_or(u32::MAX));
        }
    }

    pub(crate) fn worked(&mut self, second: usize, work: Duration, delivered: bool) {
        if let Some(w) = self.work.get_mut(second) {
            *w += work.as_secs_f64();
        }
        if !delivered {
            if let Some(w) = self.wasted.get_mut(second) {
                *w += work.as_secs_f64();
            }
        }
    }
}

/// One second of simulated time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Second {
    /// Calls made.
    pub offered: u32,
    /// Attempts sent: every attempt that left a client, refused or not.
    pub sent: u32,
    /// Attempts that reached an instance able to take them (queued,
    /// answered 503 from a full queue, or swallowed by a black hole): the
    /// load on the fleet. An attempt refused at once (an instance down,
    /// an address no instance has) is sent, not reached: it costs the
    /// fleet nothing, and the stack retries it elsewhere at once, without
    /// a budget token, while the rest of the fleet answers.
    pub reached: u32,
    /// Calls that ended 2xx within their deadline.
    pub good: u32,
    /// The 99th percentile of the time of the calls that ended (all of
    /// them, failures too).
    pub p99: Duration,
    /// Instance work finished, in seconds of work.
    pub work: f64,
    /// The part of it whose caller had already gone.
    pub wasted: f64,
}

impl Second {
    /// Calls that ended 2xx within their deadline, per call made, in this
    /// second: goodput with the arrivals' own noise taken out.
    pub fn good_share(&self) -> f64 {
        if self.offered == 0 {
            0.0
        } else {
            f64::from(self.good) / f64::from(self.offered)
        }
    }

    /// Attempts per call made.
    pub fn amplification(&self) -> f64 {
        per_call(self.sent, self.offered)
    }

    /// Attempts that reached an instance per call made: the load on the
    /// fleet, as a multiple of what the callers asked of it.
    pub fn load(&self) -> f64 {
        per_call(self.reached, self.offered)
    }
}

fn per_call(n: u32, offered: u32) -> f64 {
    if offered == 0 {
        0.0
    } else {
        f64::from(n) / f64::from(offered)
    }
}

/// How the goodput came back after the trigger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// Back to 95 % of the goodput before the trigger (for three seconds
    /// in a row) this long after the trigger's end, in whole seconds. The
    /// goodput of a second is taken as a share of the calls made in it
    /// ([`Second::good_share`]), so that the arrivals' Poisson noise (a
    /// second with 5 % fewer calls than the mean is common at a few hundred
    /// a second) is not read as a failure.
    After(Duration),
    /// Not back within the watch after the trigger's end.
    Metastable,
}

impl fmt::Display for Recovery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recovery::After(d) => write!(f, "{} s", d.as_secs()),
            Recovery::Metastable => f.write_str("metastable"),
        }
    }
}

/// The figures of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figures {
    /// Goodput per second before the trigger (from the third second).
    pub baseline: f64,
    /// The same as a share of the calls made.
    pub baseline_share: f64,
    /// When the goodput came back.
    pub recovery: Recovery,
    /// The largest attempts per call made in one second.
    pub peak_amplification: f64,
    /// The largest attempts that reached an instance per call made in one
    /// second ([`Second::load`]).
    pub peak_load: f64,
    /// Attempts per call made, from the trigger's start to the end.
    pub amplification: f64,
    /// Calls that ended 2xx within their deadline, a share of those made,
    /// from the trigger's start to the end.
    pub goodput_share: f64,
    /// The share of all instance work whose caller had already gone.
    pub wasted_share: f64,
    /// Queued requests dropped by their servers, their deadline passed.
    pub dropped: u64,
    /// Requests answered 503 because the queue was full.
    pub full: u64,
    /// Requests refused by a server's `ShedLayer` (503 with `Retry-After`,
    /// nothing done), before the trigger too.
    pub shed: u64,
    /// The 99th percentile of the calls' time before the trigger (from the
    /// third second).
    pub p99_before: Duration,
    /// The same over the last ten seconds of the run.
    pub p99_end: Duration,
}

/// A run's figures and its seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Every second of the run, from its start.
    pub seconds: Vec<Second>,
    /// The trigger, in seconds from the start.
    pub trigger: (Duration, Duration),
    /// The figures.
    pub figures: Figures,
}

fn p99(mut v: Vec<u32>) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let i = (v.len() * 99).div_ceil(100) - 1;
    let (_, at, _) = v.select_nth_unstable(i);
    Duration::from_micros(u64::from(*at))
}

pub(crate) fn report(plan: &Plan, tally: Tally) -> Report {
    let Tally {
        offered,
        sent,
        reached,
        good,
        latencies,
        work,
        wasted,
        dropped,
        full,
        shed,
    } = tally;
    let seconds: Vec<Second> = (0..offered.0.len())
        .zip(latencies.iter().cloned())
        .map(|(s, l)| Second {
            offered: offered.0[s],
            sent: sent.0[s],
            reached: reached.0[s],
            good: good.0[s],
            p99: p99(l),
            work: work[s],
            wasted: wasted[s],
        })
        .collect();
    let from = plan.model.warm_up;
    let to = from + plan.scenario.length();
    let (from_s, to_s) = (from.as_secs() as usize, to.as_secs() as usize);
    let n = seconds.len();
    let p99_of = |range: std::ops::Range<usize>| p99(latencies[range].concat());
    let before = &seconds[2.min(from_s)..from_s];
    let good_before: f64 = before.iter().map(|s| f64::from(s.good)).sum();
    let made_before: f64 = before.iter().map(|s| f64::from(s.offered)).sum();
    let baseline = good_before / before.len().max(1) as f64;
    let baseline_share = good_before / made_before.max(1.0);
    let watch = plan.model.watch.as_secs() as usize;
    let recovery = (to_s..=to_s + watch)
        .find(|&s| {
            seconds.get(s..s + HOLD).is_some_and(|w| {
                w.iter()
                    .all(|x| x.good_share() >= RECOVERED * baseline_share)
            })
        })
        .map_or(Recovery::Metastable, |s| {
            Recovery::After(Duration::from_secs((s - to_s) as u64))
        });
    let peak = |f: fn(&Second) -> f64| seconds[2.min(from_s)..].iter().map(f).fold(0.0, f64::max);
    let (peak_amplification, peak_load) = (peak(Second::amplification), peak(Second::load));
    let after = &seconds[from_s..];
    let sum = |f: fn(&Second) -> f64| after.iter().map(f).sum::<f64>();
    let made = sum(|s| f64::from(s.offered)).max(1.0);
    let all_work: f64 = seconds.iter().map(|s| s.work).sum();
    let all_wasted: f64 = seconds.iter().map(|s| s.wasted).sum();
    Report {
        trigger: (from, to),
        figures: Figures {
            baseline,
            baseline_share,
            recovery,
            peak_amplification,
            peak_load,
            amplification: sum(|s| f64::from(s.sent)) / made,
            goodput_share: sum(|s| f64::from(s.good)) / made,
            wasted_share: if all_work > 0.0 {
                all_wasted / all_work
            } else {
                0.0
            },
            dropped,
            full,
            shed,
            p99_before: p99_of(2.min(from_s)..from_s),
            p99_end: p99_of(n.saturating_sub(10).max(to_s).min(n)..n),
        },
        seconds,
    }
}
