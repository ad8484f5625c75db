use leasehold::{JobSpec, Supervisor};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke() {
    let sup = Supervisor::builder().slots(2).start().await.unwrap();
    let mut handles = vec![];
    for i in 0..10 {
        let sup = sup.clone();
        handles.push(tokio::spawn(async move {
            sup.run(JobSpec::new(format!("j{i}")).unwrap(), move |ctx| async move {
                let d = ctx.temp_dir().to_path_buf();
                let h = ctx.spawn_blocking(move || std::fs::write(d.join("x"), b"1"));
                h.await.unwrap()?;
                Ok::<_, std::io::Error>(ctx.slot_id())
            }).await
        }));
    }
    for h in handles { h.await.unwrap().unwrap(); }
    let mut l = sup.acquire().await.unwrap();
    l.release().await.unwrap();
    l.release().await.unwrap();
    println!("{:?}", sup.stats());
    let r = sup.shutdown().await.unwrap();
    println!("{r:?}");
    assert!(!sup.work_root().exists());
}
