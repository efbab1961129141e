package models

import (
	"errors"
	"fmt"
	"slices"

	"github.com/sloserve/sloserve/limiter"
	"github.com/sloserve/sloserve/runtime"
)

// This file resizes a version without waiting: each instance's unit is
// resized live at once, and the instances that must be replaced are swapped
// in the background by their pool (runtime.Pool.Swap). A later request for
// the same version supersedes one whose replacements are still starting.

// resize is one RequestShare whose replacements have not all finished.
type resize struct {
	want    limiter.Share
	members []int // the instances being replaced
	left    int   // replacements not finished
	err     error // the first replacement's error
}

// ShareStatus is where a version's share stands.
type ShareStatus struct {
	// Share is the share every instance runs at.
	Share limiter.Share
	// Pending is the share requested and not applied yet (its
	// replacements are starting or switching); nil when none.
	Pending *limiter.Share
	// Swaps is the last replacement of each instance that had one.
	Swaps []runtime.SwapStatus
	// Err is why the last request that finished did not apply; nil when
	// it did.
	Err error
}

// RequestShare gives a serving version ("model/N") a new share as SetShare
// does, without waiting for the replacements: it resizes each instance's
// unit live, starts a replacement for each instance that needs one (the
// limiter cannot resize it running, or its thread count changes) and
// returns. The pool switches to each replacement once it is warm; the share
// is recorded when every replacement has switched. A request made while
// another's replacements are still starting supersedes it: those instances
// are replaced at the new share instead. ShareStatus reports the progress.
// The error is a live resize's; a replacement's comes in ShareStatus.
func (r *Registry) RequestShare(key string, s limiter.Share) error {
	v, err := r.versionByKey(key)
	if err != nil {
		return err
	}
	v.shareMu.Lock()
	defer v.shareMu.Unlock()
	if v.retired {
		return fmt.Errorf("%w: model %s version %s is being unloaded", ErrNotReady, v.model, v.label)
	}
	if v.moving.Load() {
		return fmt.Errorf("%w: %s", ErrMoving, key)
	}
	members := v.pool.Members()
	per := instanceShare(s, len(members))
	rz := &resize{want: s}
	var errs []error
	for i, m := range members {
		restart, err := v.resizeLive(m, per, swapAlways)
		if err != nil {
			errs = append(errs, fmt.Errorf("instance %d: %w", i, err))
		} else if restart {
			rz.members = append(rz.members, i)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("model %s version %s: setting %s: %w", v.model, v.label, formatShare(s), err)
	}
	v.resizeMu.Lock()
	if prev := v.resizing; prev != nil {
		// Its instances are replaced again, at this share: a replacement
		// still starting is superseded, one switching is followed. An
		// instance that already runs at this share (the request goes
		// back to it) keeps running: its replacement, if still starting,
		// is canceled rather than followed by another new client.
		for _, i := range prev.members {
			if slices.Contains(rz.members, i) || v.pool.CancelSwap(i) {
				continue
			}
			rz.members = append(rz.members, i)
		}
	}
	rz.left = len(rz.members)
	v.resizing = rz
	v.resizeMu.Unlock()
	if rz.left == 0 {
		v.finishResize(rz)
		return nil
	}
	for _, i := range rz.members {
		v.pool.Swap(i, r.replacement(v, i, per), func(err error) {
			if err == nil {
				r.logReplaced(v, i, per)
			}
			v.replaced(rz, i, err)
		})
	}
	return nil
}

// replaced counts one finished replacement of rz's.
func (v *version) replaced(rz *resize, i int, err error) {
	v.resizeMu.Lock()
	if err != nil && rz.err == nil {
		rz.err = fmt.Errorf("instance %d: %w", i, err)
	}
	rz.left--
	done := rz.left == 0
	v.resizeMu.Unlock()
	if done {
		v.finishResize(rz)
	}
}

// finishResize records rz's share when it applied everywhere and is still
// the version's latest request.
func (v *version) finishResize(rz *resize) {
	v.resizeMu.Lock()
	defer v.resizeMu.Unlock()
	if v.resizing != rz {
		return // superseded: the later request records its own
	}
	v.resizing, v.resizeErr = nil, rz.err
	if rz.err == nil {
		v.instMu.Lock()
		v.share = rz.want
		v.instMu.Unlock()
	}
}

// ShareStatus reports a serving version's share, the one requested and not
// applied yet, and the last replacement of each instance.
func (r *Registry) ShareStatus(key string) (ShareStatus, error) {
	v, err := r.versionByKey(key)
	if err != nil {
		return ShareStatus{}, err
	}
	var st ShareStatus
	v.resizeMu.Lock()
	if rz := v.resizing; rz != nil {
		want := rz.want
		st.Pending = &want
	}
	st.Err = v.resizeErr
	v.resizeMu.Unlock()
	v.instMu.RLock()
	st.Share = v.share
	v.instMu.RUnlock()
	for i := range v.pool.Len() {
		if s, ok := v.pool.SwapStatus(i); ok {
			st.Swaps = append(st.Swaps, s)
		}
	}
	return st, nil
}

// ShareInEffect is ShareStatus as the control loop's AsyncActuator reads
// it: the share in effect, whether a requested one is still starting, and
// why the last one that finished did not apply.
func (r *Registry) ShareInEffect(key string) (limiter.Share, bool, error) {
	st, err := r.ShareStatus(key)
	if err != nil {
		return limiter.Share{}, false, err
	}
	return st.Share, st.Pending != nil, st.Err
}
