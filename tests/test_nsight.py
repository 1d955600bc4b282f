"""bench/runners/nsight.py's parsing of ncu output (no GPU, no ncu): the details page
into per-launch metrics and the summary table, the source page into SASS hot spots."""

from bench.runners import nsight

DETAILS = """==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","attn_fwd_kernel","1","7","(128, 1, 1)","(512, 12, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","9,446,208"
"0","1","python3","h","attn_fwd_kernel","1","7","(128, 1, 1)","(512, 12, 1)","0","9.0","Command line profiler metrics","smsp__issue_active.avg.pct_of_peak_sustained_active","%","54.59"
"0","1","python3","h","attn_fwd_kernel","1","7","(128, 1, 1)","(512, 12, 1)","0","9.0","Command line profiler metrics","sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active","%","47.38"
"0","1","python3","h","attn_fwd_kernel","1","7","(128, 1, 1)","(512, 12, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","","0.80"
"""

SOURCE = """"Kernel Name","attn_fwd_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_wait","stall_short_sb","stall_barrier (Not Issued)"
"0x10","      FMNMX R1, R2, R3, !PT","30","0","10","20","0"
"0x20","      WARPGROUP.DEPBAR.LE gsb0, 0x0","60","55","5","0","40"
"0x30","      MUFU.EX2 R4, R4","10","0","10","0","0"
"Kernel Name","other_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_wait","stall_short_sb","stall_barrier (Not Issued)"
"0x10","      NOP","1000","0","0","0","0"
"""


def test_details_page_gives_metrics_and_a_summary_row_with_pipe_utilization():
    launches = nsight.parse_csv(DETAILS)
    assert [launch["kernel"] for launch in launches] == ["attn_fwd_kernel"]
    metrics = launches[0]["metrics"]
    assert metrics["gpu__time_duration.sum"] == 9446208  # thousands separators dropped
    assert nsight.stalls(metrics) == [("barrier", 0.80)]
    row = nsight.summary_lines("attention", (1, 4608, 3072), {"fwd": launches})[-2]
    # busy %: issue 55, tensor not collected ('-'), XU 47, FMA and ALU not collected
    assert "| 55 / - / 47 / - / - |" in row and "barrier 0.80" in row and row.startswith("| `attn_fwd_kernel`")


def test_source_page_hot_spots_rank_the_first_kernels_instructions_by_stall_samples():
    spots = nsight.sass_hotspots(SOURCE, top=2)
    assert [s["sass"] for s in spots] == ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "FMNMX R1, R2, R3, !PT"]
    assert abs(spots[0]["share"] - 0.6) < 1e-12  # of the first kernel's 100 samples, not the second's
    assert spots[0]["reasons"][0] == ("barrier", 55)  # "(Not Issued)" columns are not reasons of their own
    table = nsight.sass_lines("fwd", spots)
    assert (
        table[0].startswith("### fwd") and "| 60.0% | `WARPGROUP.DEPBAR.LE gsb0, 0x0` | barrier 55, wait 5" in table[4]
    )
    assert nsight.sass_hotspots("no csv here") == []
