//! The `kindred` command line: help everywhere, swarm keys, and a stable identity across `init`s.
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn kindred() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kindred"))
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kindred-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn help_is_available_for_every_command() {
    for cmd in [
        &[][..],
        &["init"],
        &["run"],
        &["status"],
        &["swarm-key"],
        &["demo"],
    ] {
        let out = kindred().args(cmd).arg("--help").output().unwrap();
        assert!(out.status.success(), "{cmd:?} --help");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Usage"),
            "{cmd:?}"
        );
    }
}

#[test]
fn swarm_key_is_written_once_in_the_pnet_format() {
    let dir = tempdir("swarm-key");
    let key = dir.join("swarm.key");
    let out = kindred()
        .args(["swarm-key", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = std::fs::read_to_string(&key).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(&lines[..2], ["/key/swarm/psk/1.0.0/", "/base16/"]);
    assert_eq!(lines[2].len(), 64);
    assert!(kindred_node::run::read_swarm_key(&key).is_ok());
    // The key is a secret: readable by its owner only.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "swarm key mode {mode:o}");
        assert!(!kindred_node::run::key_file_too_open(mode));
    }
    // Never overwrite an existing key.
    let again = kindred()
        .args(["swarm-key", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert_eq!(std::fs::read_to_string(&key).unwrap(), text);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn init_keeps_the_identity_and_writes_the_config() {
    let dir = tempdir("init");
    let first = kindred()
        .args(["init", "--round-secs", "4", "--upnp", "--data-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let second = kindred()
        .args(["init", "--data-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(first.stdout, second.stdout, "same PeerId on every init");
    let config = kindred_node::config::NodeConfig::load(&dir).unwrap();
    assert_eq!(config.round_secs, 4.0);
    assert!(config.upnp, "`--upnp` alone turns it on");
    // A typo in the config file is an error, not a silent default.
    std::fs::write(dir.join("kindred.toml"), "round_sec = 3\n").unwrap();
    let bad = kindred()
        .args(["init", "--data-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    std::fs::remove_dir_all(dir).unwrap();
}
