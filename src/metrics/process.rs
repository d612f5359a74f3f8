//! The standard `process_*` series, read from `/proc/self` at each scrape.
//!
//! prometheus' own `process` feature would add five crates (procfs, procfs-core, rustix 0.38,
//! linux-raw-sys 0.4, hex) for the same six numbers, and reports CPU time in whole seconds;
//! this reads three small files and keeps the fraction, as the other Prometheus clients do.
//! Clock ticks and the page size come from the auxiliary vector (`/proc/self/auxv`), which
//! needs no `sysconf` call and so no unsafe code. Where `/proc` cannot be read (not Linux), the
//! series are left out.

use std::path::Path;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Counter, Gauge, IntGauge};

pub struct ProcessCollector {
    descs: Vec<Desc>,
    cpu: Counter,
    resident: IntGauge,
    virtual_memory: IntGauge,
    open_fds: IntGauge,
    max_fds: IntGauge,
    start_time: Gauge,
    /// Clock ticks per second and page size in bytes; `None` where `/proc` is not there.
    units: Option<Units>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Units {
    ticks: f64,
    page: u64,
}

impl ProcessCollector {
    pub fn new() -> Self {
        let cpu = Counter::new(
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
        )
        .expect("valid metric");
        let resident = IntGauge::new(
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
        )
        .expect("valid metric");
        let virtual_memory = IntGauge::new(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
        )
        .expect("valid metric");
        let open_fds =
            IntGauge::new("process_open_fds", "Number of open file descriptors.").expect("valid");
        let max_fds = IntGauge::new(
            "process_max_fds",
            "Maximum number of open file descriptors.",
        )
        .expect("valid metric");
        let start_time = Gauge::new(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
        )
        .expect("valid metric");
        let units = units();
        if let Some(units) = units {
            let stat = read("/proc/self/stat").and_then(|s| Stat::parse(&s));
            let boot = read("/proc/stat").and_then(|s| boot_time(&s));
            if let (Some(stat), Some(boot)) = (stat, boot) {
                start_time.set(boot as f64 + stat.start_ticks as f64 / units.ticks);
            }
        }
        let mut descs = Vec::new();
        for desc in [
            cpu.desc(),
            resident.desc(),
            virtual_memory.desc(),
            open_fds.desc(),
            max_fds.desc(),
            start_time.desc(),
        ] {
            descs.extend(desc.into_iter().cloned());
        }
        ProcessCollector {
            descs,
            cpu,
            resident,
            virtual_memory,
            open_fds,
            max_fds,
            start_time,
            units,
        }
    }
}

impl Default for ProcessCollector {
    fn default() -> Self {
        Self::new()
    }
}

impl Collector for ProcessCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let Some(units) = self.units else {
            return Vec::new();
        };
        let mut families = Vec::with_capacity(6);
        if let Some(stat) = read("/proc/self/stat").and_then(|s| Stat::parse(&s)) {
            // A counter only goes up: add what was spent since the last scrape.
            let total = (stat.utime + stat.stime) as f64 / units.ticks;
            let past = self.cpu.get();
            if total > past {
                self.cpu.inc_by(total - past);
            }
            self.resident
                .set(i64::try_from(stat.rss_pages.saturating_mul(units.page)).unwrap_or(i64::MAX));
            self.virtual_memory
                .set(i64::try_from(stat.vsize).unwrap_or(i64::MAX));
            families.extend(self.cpu.collect());
            families.extend(self.resident.collect());
            families.extend(self.virtual_memory.collect());
        }
        if let Ok(entries) = std::fs::read_dir("/proc/self/fd") {
            // Counts the descriptor that reads the directory too, as other clients do.
            self.open_fds.set(entries.count() as i64);
            families.extend(self.open_fds.collect());
        }
        if let Some(max) = read("/proc/self/limits").and_then(|s| max_open_files(&s)) {
            self.max_fds.set(i64::try_from(max).unwrap_or(i64::MAX));
            families.extend(self.max_fds.collect());
        }
        if self.start_time.get() > 0.0 {
            families.extend(self.start_time.collect());
        }
        families
    }
}

fn read(path: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// The fields of `/proc/self/stat` used here (proc(5)).
#[derive(Debug, PartialEq)]
struct Stat {
    utime: u64,
    stime: u64,
    start_ticks: u64,
    vsize: u64,
    rss_pages: u64,
}

impl Stat {
    fn parse(text: &str) -> Option<Stat> {
        // The command name (field 2) is in parentheses and may hold spaces and parentheses
        // itself: the fields after it start after the last `)`.
        let rest = &text[text.rfind(')')? + 1..];
        let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
        // `rest` starts at field 3 (state).
        let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
        Some(Stat {
            utime: field(14)?,
            stime: field(15)?,
            start_ticks: field(22)?,
            vsize: field(23)?,
            rss_pages: field(24)?,
        })
    }
}

/// `btime` of `/proc/stat`: the boot time, in seconds since the epoch.
fn boot_time(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// The soft limit of `Max open files` in `/proc/self/limits` (`None` when unlimited).
fn max_open_files(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|rest| rest.split_ascii_whitespace().next())
        .and_then(|soft| soft.parse().ok())
}

/// Clock ticks per second (`AT_CLKTCK`) and the page size (`AT_PAGESZ`) from the auxiliary
/// vector: pairs of native-endian machine words, type then value.
fn units() -> Option<Units> {
    auxv_units(&std::fs::read("/proc/self/auxv").ok()?)
}

fn auxv_units(auxv: &[u8]) -> Option<Units> {
    const AT_PAGESZ: u64 = 6;
    const AT_CLKTCK: u64 = 17;
    const WORD: usize = std::mem::size_of::<usize>();
    let word = |bytes: &[u8]| -> u64 {
        let mut w = [0u8; WORD];
        w.copy_from_slice(bytes);
        usize::from_ne_bytes(w) as u64
    };
    let (mut ticks, mut page) = (None, None);
    for pair in auxv.chunks_exact(2 * WORD) {
        match word(&pair[..WORD]) {
            AT_PAGESZ => page = Some(word(&pair[WORD..])),
            AT_CLKTCK => ticks = Some(word(&pair[WORD..])),
            _ => {}
        }
    }
    match (ticks?, page?) {
        (0, _) | (_, 0) => None,
        (ticks, page) => Some(Units {
            ticks: ticks as f64,
            page,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_stat_fields_after_a_command_name_with_spaces_and_parentheses() {
        let line = "4242 (fence gate) (x)) S 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    250 75 0 0 20 0 3 0 123456 104857600 2048 18446744073709551615";
        assert_eq!(
            Stat::parse(line),
            Some(Stat {
                utime: 250,
                stime: 75,
                start_ticks: 123456,
                vsize: 104857600,
                rss_pages: 2048,
            })
        );
        assert_eq!(Stat::parse("4242 (cut short) S 1 2"), None);
    }

    #[test]
    fn reads_boot_time_and_the_soft_fd_limit() {
        assert_eq!(
            boot_time("cpu  1 2 3\nintr 5\nbtime 1764500000\nprocesses 9\n"),
            Some(1764500000)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             63704                63704                processes \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(max_open_files(limits), Some(1024));
        let unlimited =
            "Max open files            unlimited            unlimited            files\n";
        assert_eq!(max_open_files(unlimited), None);
    }

    #[test]
    fn reads_ticks_and_page_size_from_the_auxiliary_vector() {
        let mut auxv = Vec::new();
        for (kind, value) in [(33usize, 7usize), (6, 4096), (17, 100), (0, 0)] {
            auxv.extend_from_slice(&kind.to_ne_bytes());
            auxv.extend_from_slice(&value.to_ne_bytes());
        }
        assert_eq!(
            auxv_units(&auxv),
            Some(Units {
                ticks: 100.0,
                page: 4096
            })
        );
        assert_eq!(auxv_units(&auxv[..2 * std::mem::size_of::<usize>()]), None);
    }

    /// On Linux, this process's own numbers: every series is there and plausible.
    #[test]
    fn exports_the_six_series_for_this_process() {
        if !Path::new("/proc/self/stat").exists() {
            return;
        }
        // At least one clock tick of CPU time spent, so that the counter has one to show.
        let ticks = || {
            let stat = Stat::parse(&read("/proc/self/stat").unwrap()).unwrap();
            stat.utime + stat.stime
        };
        let mut spin = 0u64;
        while ticks() == 0 {
            spin = std::hint::black_box(spin.wrapping_add(1));
        }
        let registry = prometheus::Registry::new();
        registry
            .register(Box::new(ProcessCollector::new()))
            .unwrap();
        let families = registry.gather();
        let names: Vec<&str> = families.iter().map(|f| f.name()).collect();
        assert_eq!(
            names,
            [
                "process_cpu_seconds_total",
                "process_max_fds",
                "process_open_fds",
                "process_resident_memory_bytes",
                "process_start_time_seconds",
                "process_virtual_memory_bytes",
            ]
        );
        let value = |name: &str| {
            let text = prometheus::TextEncoder::new()
                .encode_to_string(&families)
                .unwrap();
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .unwrap_or_else(|| panic!("no {name} in\n{text}"))
                .parse::<f64>()
                .unwrap()
        };
        assert!(value("process_resident_memory_bytes") > 1e6);
        assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_max_fds") >= value("process_open_fds"));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let started = value("process_start_time_seconds");
        assert!(
            started <= now + 1.0 && started > now - 86_400.0,
            "{started}"
        );
        assert!(value("process_cpu_seconds_total") > 0.0);
    }
}
