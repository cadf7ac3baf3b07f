//! CPU time of processes and threads, read from `/proc` (Linux), for the
//! benchmarks that print CPU per message beside their throughput.

use std::path::Path;

/// CPU time (user + system) in ms from a `/proc/.../stat` file (Linux
/// reports it in USER_HZ = 100 ticks a second); 0 if it cannot be read.
pub fn stat_cpu_ms(path: &Path) -> u64 {
    let Ok(stat) = std::fs::read_to_string(path) else {
        return 0;
    };
    let Some(close) = stat.rfind(')') else {
        return 0;
    };
    // The fields after the command name; utime and stime are fields 14 and
    // 15 of the whole line.
    let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (ticks(11) + ticks(12)) * 10
}

/// CPU time in ms of the process `pid` (all its threads); 0 if it is gone.
pub fn process_cpu_ms(pid: u32) -> u64 {
    stat_cpu_ms(Path::new(&format!("/proc/{pid}/stat")))
}

/// CPU time in ms of this process (all its threads).
pub fn own_cpu_ms() -> u64 {
    stat_cpu_ms(Path::new("/proc/self/stat"))
}

/// The pid of this process's child named `name` (tansu is spawned directly).
pub fn child_pid(name: &str) -> Option<u32> {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let (open, close) = (stat.find('(')?, stat.rfind(')')?);
            let ppid = stat[close + 2..].split_whitespace().nth(1)?;
            (&stat[open + 1..close] == name && ppid == me).then_some(pid)
        })
}
