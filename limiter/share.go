// Package limiter enforces shares of a device on real resources: cgroups on CPU, MPS on GPU.
package limiter

// Share is the part of a device given to one model instance.
type Share struct {
	Compute float64 // fraction of the device's compute; 0 or >= 1 means no compute limit
	Memory  int64   // bytes; 0 means no memory limit
}
