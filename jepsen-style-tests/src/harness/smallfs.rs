//! A node's data dir on a filesystem of its own (tmpfs) whose size the `disk-full` nemesis
//! squeezes to what is in use plus a little, and then gives back: the node runs out of space
//! with its files in place, and gets the space back without a restart. Needs root (`mount`).
//! Unmounted (lazily, so a process still inside does not block it) on drop.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The size of a node's tmpfs while it is not squeezed: room for RocksDB's preallocated WALs
/// (~70 MB each) and a few snapshots.
const ROOMY_BYTES: u64 = 512 << 20;

pub struct SmallFs {
    dir: PathBuf,
}

fn run(cmd: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("running {cmd}"))?;
    if !out.status.success() {
        bail!(
            "`{cmd} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether this process may mount filesystems (it runs as root).
pub fn can_mount() -> bool {
    run("id", &["-u"]).is_ok_and(|u| u.trim() == "0")
}

impl SmallFs {
    /// Moves the (stopped) node's data dir `dir` onto a new tmpfs mounted in its place.
    pub fn take_over(dir: &Path) -> Result<SmallFs> {
        let aside = dir.with_extension("on-disk");
        let _ = std::fs::remove_dir_all(&aside);
        if dir.exists() {
            std::fs::rename(dir, &aside).with_context(|| format!("moving {} aside", dir.display()))?;
        }
        std::fs::create_dir_all(dir)?;
        let d = dir.display().to_string();
        run(
            "mount",
            &["-t", "tmpfs", "-o", &format!("size={ROOMY_BYTES}"), "tmpfs", &d],
        )?;
        let me = SmallFs { dir: dir.to_path_buf() };
        if aside.exists() {
            run("cp", &["-a", &format!("{}/.", aside.display()), &d])?;
            std::fs::remove_dir_all(&aside)?;
        }
        Ok(me)
    }

    /// Bytes in use on the filesystem.
    pub fn used(&self) -> Result<u64> {
        let out = run("stat", &["-f", "-c", "%b %f %S", &self.dir.display().to_string()])?;
        let v: Vec<u64> = out.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        match v[..] {
            [blocks, free, size] => Ok((blocks - free) * size),
            _ => bail!("cannot read the usage of {}: {out:?}", self.dir.display()),
        }
    }

    /// Shrinks the filesystem to what is in use plus `spare` bytes; returns the new size.
    pub fn squeeze(&self, spare: u64) -> Result<u64> {
        let size = self.used()? + spare;
        self.resize(size)?;
        Ok(size)
    }

    /// Gives the room back.
    pub fn release(&self) -> Result<()> {
        self.resize(ROOMY_BYTES)
    }

    fn resize(&self, bytes: u64) -> Result<()> {
        run(
            "mount",
            &["-o", &format!("remount,size={bytes}"), &self.dir.display().to_string()],
        )?;
        Ok(())
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = run("umount", &["-l", &self.dir.display().to_string()]);
    }
}
