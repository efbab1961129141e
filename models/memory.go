package models

import "github.com/sloserve/sloserve/runtime"

// This file reads the memory of a version's instances for the control
// loop's memory shares: the peak an instance reached (what the profiling
// sweep records per batch size) and what the largest instance holds now
// (below which no memory share may go).

// workingSetReader is the profile run's memory reading (ProfileRun.Memory):
// the instance's peak, or nil for a version with an input whose shape is
// dynamic in more than the batch. Such a version is profiled at the
// config's profile.shapes, and a request at a larger shape needs more
// memory than any profiled batch: a memory share sized from the profile
// would have the kernel kill the runner for it, so the version records no
// working set and its memory share stays at its memory_limit.
func (v *version) workingSetReader() func() int64 {
	if sample, _ := samplesFor(v, nil); sample == nil {
		return nil
	}
	return v.peakMemory
}

// peakMemory is the most memory one instance of the version has used, as
// its limiter unit reads it (the unit's peak, or its current use where the
// kernel keeps no peak); 0 unknown.
func (v *version) peakMemory() int64 {
	if v.lim == nil {
		return 0
	}
	var most int64
	for _, m := range v.pool.Members() {
		u := v.unitOf(m)
		if u.id == "" {
			continue
		}
		st, err := v.lim.Stats(u.id)
		if err != nil {
			continue
		}
		most = max(most, st.MemoryPeak, st.MemoryBytes)
	}
	return most
}

// InstanceMemory is the memory the largest instance of a serving version
// ("model/N") uses now, as its limiter unit counts it against its memory
// limit (a cgroup's memory.current or memory.usage_in_bytes); 0 unknown.
// A memory share below it would have the kernel kill the instance, so the
// control loop reads it before it shrinks one.
func (r *Registry) InstanceMemory(key string) int64 {
	v, err := r.versionByKey(key)
	if err != nil || v.lim == nil {
		return 0
	}
	var most int64
	for _, m := range v.pool.Members() {
		most = max(most, v.currentMemory(m))
	}
	return most
}

// currentMemory is what member m's limiter unit counts against its memory
// limit now; 0 unknown.
func (v *version) currentMemory(m runtime.Member) int64 {
	u := v.unitOf(m)
	if u.id == "" {
		return 0
	}
	st, err := v.lim.Stats(u.id)
	if err != nil {
		return 0
	}
	return st.MemoryBytes
}
