//! Peak memory of this process, as the kernel reports it.

/// Peak resident set size (`VmHWM` in `/proc/self/status`) in MiB; `None` where the file is not
/// available (not Linux).
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn peak_rss_is_positive_on_linux() {
        if cfg!(target_os = "linux") {
            let mb = super::peak_rss_mb().unwrap();
            assert!(mb > 0.1 && mb < 1e6, "{mb}");
        }
    }
}
