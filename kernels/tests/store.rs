//! The tiered weight store on real files: round trips, budgets, corruption, reopening.

use std::io::{Seek, SeekFrom, Write};

use troupe_kernels::{Device, KernelError, Tier, WeightStore};

fn tmpdir() -> tempfile::TempDir {
    // The target directory is on a real disk (O_DIRECT works); /tmp may be tmpfs on CI.
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir under the target dir")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn round_trip_through_all_tiers() {
    let dir = tmpdir();
    let mut s = WeightStore::open(dir.path(), &Device::Cpu, 1 << 20, 1 << 20).unwrap();
    let data = pattern(300_001, 7); // unaligned length: exercises the O_DIRECT tail
    let id = s.put("expert-0.w1", &data).unwrap();
    assert_eq!(s.tier(&id).unwrap(), Tier::Disk);

    let host = s.load_to_host(&id).unwrap();
    assert_eq!(&host[..], &data[..]);
    assert_eq!(s.tier(&id).unwrap(), Tier::Host);
    assert_eq!(s.stats().host_used, 300_001);

    let a = s.promote_to_device(&id).unwrap();
    assert_eq!(s.tier(&id).unwrap(), Tier::Device);
    assert_eq!(s.stats().host_used, 0, "tiers are exclusive: host copy released");
    assert_eq!(a.len, 300_032, "rounded to the arena's 256-byte alignment");
    assert_eq!(s.read(&id).unwrap(), data);

    assert_eq!(s.evict(&id).unwrap(), Tier::Host);
    assert_eq!(s.read(&id).unwrap(), data);
    assert_eq!(s.stats().device.used, 0);
    assert_eq!(s.evict(&id).unwrap(), Tier::Disk);
    assert_eq!(s.read(&id).unwrap(), data);

    // Straight from disk to device (staging buffer, no host budget needed).
    s.promote_to_device(&id).unwrap();
    assert_eq!(s.read(&id).unwrap(), data);

    let st = s.stats();
    assert_eq!(st.disk_to_host.count, 1);
    assert_eq!(st.disk_to_host.bytes, 300_001);
    assert_eq!(st.host_to_device.count, 1);
    assert_eq!(st.device_to_host.count, 1);
    assert_eq!(st.disk_to_device.count, 1);
    assert_eq!(st.disk_writes.bytes, 300_001);
    assert!(st.disk_to_host.seconds > 0.0 && st.disk_to_host.mb_per_s() > 0.0);
    assert_eq!(st.odirect_fallbacks, 0, "the target directory's filesystem accepts O_DIRECT");
}

#[test]
fn budgets_are_enforced_with_clear_errors() {
    let dir = tmpdir();
    let mut s = WeightStore::open(dir.path(), &Device::Cpu, 4096, 1000).unwrap();
    let small = s.put("small", &pattern(600, 1)).unwrap();
    let other = s.put("other", &pattern(600, 2)).unwrap();
    s.load_to_host(&small).unwrap();
    let err = s.load_to_host(&other).unwrap_err();
    match &err {
        KernelError::TierFull { tier, blob, needed, available, budget } => {
            assert_eq!(
                (*tier, blob.as_str(), *needed, *available, *budget),
                ("host", "other", 600, 400, 1000)
            );
        }
        e => panic!("wrong error {e}"),
    }
    assert!(err.to_string().contains("other"), "{err}");
    assert_eq!(s.tier(&other).unwrap(), Tier::Disk, "a refused load changes nothing");

    let big = s.put("big", &pattern(5000, 3)).unwrap();
    let err = s.promote_to_device(&big).unwrap_err();
    assert!(matches!(err, KernelError::TierFull { tier: "device", .. }), "{err}");
    assert!(err.to_string().contains("big"));
    // Device full of `small` (768 of 4096 after alignment) still takes `other`.
    s.promote_to_device(&small).unwrap();
    s.promote_to_device(&other).unwrap();
    assert_eq!(s.stats().device.used, 2 * 768);

    // Host full: loading a device blob to the host is refused and leaves it on the device;
    // evicting it falls through to disk.
    let filler = s.put("filler", &pattern(1000, 4)).unwrap();
    s.load_to_host(&filler).unwrap();
    let err = s.load_to_host(&small).unwrap_err();
    assert!(matches!(err, KernelError::TierFull { tier: "host", .. }), "{err}");
    assert_eq!(s.tier(&small).unwrap(), Tier::Device);
    assert_eq!(s.evict(&small).unwrap(), Tier::Disk);
    assert_eq!(s.read(&small).unwrap(), pattern(600, 1));
}

#[test]
fn corrupted_blob_is_detected_by_name() {
    let dir = tmpdir();
    let mut s = WeightStore::open(dir.path(), &Device::Cpu, 1 << 16, 1 << 16).unwrap();
    let id = s.put("expert-3", &pattern(10_000, 9)).unwrap();
    let path = s.path_of(&id).unwrap().to_path_buf();
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.seek(SeekFrom::Start(WeightStore::data_offset() + 1234)).unwrap();
    f.write_all(&[0xAA]).unwrap();
    f.sync_all().unwrap();
    let err = s.load_to_host(&id).unwrap_err();
    assert!(matches!(err, KernelError::Corrupted { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("expert-3") && msg.contains("corrupted"), "{msg}");
    assert_eq!(s.tier(&id).unwrap(), Tier::Disk);
    assert_eq!(s.stats().host_used, 0);
    assert!(s.promote_to_device(&id).is_err());
    assert_eq!(s.stats().device.used, 0, "a failed promotion frees its allocation");
}

#[test]
fn corruption_in_a_later_block_is_detected() {
    // Over one 4 MiB read block: the checksum runs on a helper thread while blocks stream in.
    let dir = tmpdir();
    let mut s = WeightStore::open(dir.path(), &Device::Cpu, 0, 16 << 20).unwrap();
    let data = pattern((9 << 20) + 17, 3);
    let id = s.put("big-expert", &data).unwrap();
    assert_eq!(&s.load_to_host(&id).unwrap()[..], &data[..]);
    s.evict(&id).unwrap();
    let path = s.path_of(&id).unwrap().to_path_buf();
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.seek(SeekFrom::Start(WeightStore::data_offset() + (9 << 20) + 3)).unwrap();
    f.write_all(&[0x55]).unwrap();
    f.sync_all().unwrap();
    let err = s.load_to_host(&id).unwrap_err().to_string();
    assert!(err.contains("big-expert") && err.contains("corrupted"), "{err}");
}

#[test]
fn reopen_indexes_blobs_and_rejects_bad_headers() {
    let dir = tmpdir();
    let data = pattern(5000, 5);
    {
        let mut s = WeightStore::open(dir.path(), &Device::Cpu, 0, 1 << 16).unwrap();
        s.put("kept", &data).unwrap();
    }
    let mut s = WeightStore::open(dir.path(), &Device::Cpu, 0, 1 << 16).unwrap();
    let ids = s.ids();
    assert_eq!(ids.len(), 1);
    assert_eq!(s.len_of(&ids[0]).unwrap(), 5000);
    assert_eq!(s.read(&ids[0]).unwrap(), data);

    std::fs::write(dir.path().join("junk.blob"), b"not a blob").unwrap();
    let err = WeightStore::open(dir.path(), &Device::Cpu, 0, 1 << 16).unwrap_err();
    assert!(matches!(err, KernelError::BadBlobFile { .. }), "{err}");
    assert!(err.to_string().contains("junk.blob"));
    assert!(s.put("../escape", &data).is_err(), "ids cannot name other paths");
}
