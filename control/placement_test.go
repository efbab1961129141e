package control

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sloserve/sloserve/qos"
)

func gpus(n int, mem int64) []PlacementDevice {
	out := make([]PlacementDevice, n)
	for i := range out {
		out[i] = PlacementDevice{Name: "cuda:" + string(rune('0'+i)), Memory: mem}
	}
	return out
}

func lcModel(name string, demand float64, dev string) PlacementModel {
	return PlacementModel{Name: name, Class: qos.ClassLatencyCritical, Demand: demand, Memory: gib, Device: dev}
}

func beModel(name string, demand float64, dev string) PlacementModel {
	return PlacementModel{Name: name, Class: qos.ClassBestEffort, Demand: demand, Memory: gib, Device: dev}
}

func yielding(m PlacementModel) PlacementModel {
	m.Yields = true
	return m
}

func devicesOf(got map[string]Placed) map[string]string {
	out := map[string]string{}
	for name, p := range got {
		out[name] = p.Device
	}
	return out
}

func TestAssign(t *testing.T) {
	risky := beModel("be-risky", 0.1, "")
	risky.Risky = true
	big := func(name string) PlacementModel {
		m := lcModel(name, 0.1, "")
		m.Memory = 4 * gib
		return m
	}
	cases := []struct {
		name   string
		devs   []PlacementDevice
		models []PlacementModel
		want   map[string]string // the placed models' devices
		err    string
	}{
		{
			name:   "latency-critical models spread one a device",
			devs:   gpus(4, 40*gib),
			models: []PlacementModel{lcModel("a", 0.6, ""), lcModel("b", 0.6, ""), lcModel("c", 0.6, ""), lcModel("d", 0.6, "")},
			want:   map[string]string{"a": "cuda:0", "b": "cuda:1", "c": "cuda:2", "d": "cuda:3"},
		},
		{
			name: "beside the placed ones: the least loaded device",
			devs: gpus(3, 40*gib),
			models: []PlacementModel{lcModel("x", 0.7, "cuda:0"), lcModel("y", 0.2, "cuda:1"), lcModel("z", 0.5, "cuda:2"),
				lcModel("new", 0.3, "")},
			want: map[string]string{"new": "cuda:1"},
		},
		{
			name:   "memory with one shadow's headroom: a second 4GiB model does not fit in 10GiB",
			devs:   gpus(2, 10*gib),
			models: []PlacementModel{big("m1"), big("m2")},
			want:   map[string]string{"m1": "cuda:0", "m2": "cuda:1"},
		},
		{
			name:   "no device with room",
			devs:   gpus(1, 10*gib),
			models: []PlacementModel{big("m1"), big("m2")},
			want:   map[string]string{"m1": "cuda:0"},
			err:    "no device has room for m2",
		},
		{
			name:   "risky best effort goes apart from latency-critical models",
			devs:   gpus(2, 40*gib),
			models: []PlacementModel{lcModel("lc", 0.3, "cuda:0"), beModel("be", 0.5, "cuda:1"), risky},
			want:   map[string]string{"be-risky": "cuda:1"},
		},
		{
			name:   "the same model not risky goes where the load is least",
			devs:   gpus(2, 40*gib),
			models: []PlacementModel{lcModel("lc", 0.3, "cuda:0"), beModel("be", 0.5, "cuda:1"), beModel("be-risky", 0.1, "")},
			want:   map[string]string{"be-risky": "cuda:0"},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := Assign(c.devs, c.models)
			if (err == nil) != (c.err == "") || (err != nil && !strings.Contains(err.Error(), c.err)) {
				t.Fatalf("error %v, want %q", err, c.err)
			}
			if d := devicesOf(got); !maps.Equal(d, c.want) {
				t.Errorf("placed %v, want %v", d, c.want)
			}
			for name, p := range got {
				if p.Reason == "" {
					t.Errorf("%s placed without a reason", name)
				}
			}
		})
	}
}

func TestPlanMoves(t *testing.T) {
	pinned := lcModel("pinned", 0.7, "cuda:0")
	pinned.Pinned = true
	pinned2 := lcModel("pinned2", 0.7, "cuda:0")
	pinned2.Pinned = true
	riskyBE := beModel("be-risky", 0.2, "cuda:0")
	riskyBE.Risky = true
	tooBig := lcModel("big", 0.7, "cuda:0")
	tooBig.Memory = 30 * gib
	cases := []struct {
		name    string
		devs    []PlacementDevice
		models  []PlacementModel
		movable func(string) bool
		want    []string // "model from->to"
	}{
		{
			name:   "an overloaded device gives a model to an idle one",
			devs:   gpus(2, 40*gib),
			models: []PlacementModel{lcModel("a", 0.7, "cuda:0"), lcModel("b", 0.6, "cuda:0")},
			want:   []string{"a cuda:0->cuda:1"},
		},
		{
			// A batch job below normal priority fills cuda:0: counted
			// as load, it pushes a service over to cuda:1 beside the
			// other; yielding, it keeps nothing from them.
			name:   "a batch job that does not yield pushes a service away",
			devs:   gpus(2, 40*gib),
			models: []PlacementModel{beModel("be", 0.9, "cuda:0"), lcModel("a", 0.3, "cuda:0"), lcModel("b", 0.3, "cuda:1")},
			want:   []string{"a cuda:0->cuda:1"},
		},
		{
			name:   "a batch job that yields does not",
			devs:   gpus(2, 40*gib),
			models: []PlacementModel{yielding(beModel("be", 0.9, "cuda:0")), lcModel("a", 0.3, "cuda:0"), lcModel("b", 0.3, "cuda:1")},
			want:   nil,
		},
		{
			name: "batch jobs that yield spread among themselves",
			devs: gpus(2, 40*gib),
			models: []PlacementModel{yielding(beModel("be1", 0.9, "cuda:0")), yielding(beModel("be2", 0.9, "cuda:0")),
				lcModel("a", 0.3, "cuda:1")},
			want: []string{"be1 cuda:0->cuda:1"},
		},
		{
			name:   "a small imbalance is not worth a move",
			devs:   gpus(2, 40*gib),
			models: []PlacementModel{lcModel("a", 0.3, "cuda:0"), lcModel("b", 0.05, "cuda:0"), lcModel("c", 0.3, "cuda:1")},
			want:   nil,
		},
		{
			name:   "pinned models stay however loaded",
			devs:   gpus(2, 40*gib),
			models: []PlacementModel{pinned, pinned2},
			want:   nil,
		},
		{
			name: "at most one move per device per pass",
			devs: gpus(4, 40*gib),
			models: []PlacementModel{lcModel("a", 0.5, "cuda:0"), lcModel("b", 0.5, "cuda:0"), lcModel("c", 0.5, "cuda:0"),
				lcModel("d", 0.5, "cuda:0")},
			want: []string{"a cuda:0->cuda:1"},
		},
		{
			name: "two overloaded devices move in the same pass, to distinct targets",
			devs: gpus(4, 40*gib),
			models: []PlacementModel{lcModel("a", 0.7, "cuda:0"), lcModel("b", 0.6, "cuda:0"),
				lcModel("c", 0.7, "cuda:1"), lcModel("d", 0.6, "cuda:1")},
			want: []string{"a cuda:0->cuda:2", "c cuda:1->cuda:3"},
		},
		{
			name:   "risky best effort leaves a latency-critical device",
			devs:   gpus(2, 40*gib),
			models: []PlacementModel{lcModel("lc", 0.4, "cuda:0"), riskyBE, beModel("be", 0.4, "cuda:1")},
			want:   []string{"be-risky cuda:0->cuda:1"},
		},
		{
			name:   "no move to a device without room for the model and a shadow",
			devs:   gpus(2, 40*gib),
			models: []PlacementModel{tooBig, lcModel("b", 0.6, "cuda:0"), lcModel("c", 0.1, "cuda:1"), func() PlacementModel { m := beModel("fill", 0.0, "cuda:1"); m.Memory = 15 * gib; return m }()},
			want:   []string{"b cuda:0->cuda:1"},
		},
		{
			name:    "a model within its residence stays",
			devs:    gpus(2, 40*gib),
			models:  []PlacementModel{lcModel("a", 0.7, "cuda:0"), lcModel("b", 0.6, "cuda:0")},
			movable: func(name string) bool { return name != "a" },
			want:    []string{"b cuda:0->cuda:1"},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			moves := PlanMoves(c.devs, c.models, defaultMinGain, c.movable)
			var got []string
			for _, m := range moves {
				got = append(got, m.Model+" "+m.From+"->"+m.To)
				if m.Gain < defaultMinGain || !strings.Contains(m.Reason, "cost lower by") {
					t.Errorf("move %+v: gain under the minimum or no reason", m)
				}
			}
			if !slices.Equal(got, c.want) {
				t.Errorf("moves %v, want %v", got, c.want)
			}
		})
	}
}

// fakeMover moves models in a shared map and counts the moves.
type fakeMover struct {
	mu     sync.Mutex
	where  map[string]string
	moves  []string
	failOn string
}

func (f *fakeMover) Move(_ context.Context, model, device string) error {
	time.Sleep(time.Second) // a warm shadow takes a while
	f.mu.Lock()
	defer f.mu.Unlock()
	if model == f.failOn {
		return errors.New("no room")
	}
	f.moves = append(f.moves, model+"->"+device)
	f.where[model] = device
	return nil
}

func TestPlacerPassesHysteresis(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		demand := map[string]float64{"a": 0.5, "b": 0.5, "c": 0.1}
		mover := &fakeMover{where: map[string]string{"a": "cuda:0", "b": "cuda:0", "c": "cuda:1"}}
		snapshot := func() ([]PlacementDevice, []PlacementModel) {
			mover.mu.Lock()
			defer mover.mu.Unlock()
			var ms []PlacementModel
			for _, name := range slices.Sorted(maps.Keys(mover.where)) {
				ms = append(ms, lcModel(name, demand[name], mover.where[name]))
			}
			return gpus(2, 40*gib), ms
		}
		p, err := NewPlacer(PlacerOptions{Period: 10 * time.Second, MinGain: 0.1, MinResidence: time.Minute, Snapshot: snapshot, Mover: mover})
		if err != nil {
			t.Fatal(err)
		}
		ctx := t.Context()
		// The first pass sees the models for the first time: they settle.
		if moves := p.Pass(ctx); len(moves) != 0 {
			t.Fatalf("first pass moved %v, want none within the residence", moves)
		}
		time.Sleep(time.Minute)
		// a+b = 1.0 on cuda:0, c = 0.1 on cuda:1: one of a, b moves.
		if moves := p.Pass(ctx); len(moves) != 1 || moves[0].To != "cuda:1" {
			t.Fatalf("moves %v, want one to cuda:1", moves)
		}
		// Balanced now (0.5 against 0.6): nothing more, however long.
		for range 5 {
			time.Sleep(time.Minute)
			if moves := p.Pass(ctx); len(moves) != 0 {
				t.Fatalf("a balanced placement moved %v", moves)
			}
		}
		// The mix drifts: c grows; the model that moved may move again
		// only after its residence.
		demand["c"] = 0.9
		moves := p.Pass(ctx)
		if len(moves) != 1 {
			t.Fatalf("after the drift: moves %v, want one", moves)
		}
		var kinds []string
		for _, e := range p.Events(time.Time{}, 0) {
			kinds = append(kinds, e.Kind)
			if e.Reason == "" {
				t.Errorf("event %+v without a reason", e)
			}
		}
		if !slices.Equal(kinds, []string{EventMove, EventMove}) {
			t.Errorf("events %v, want two moves", kinds)
		}
		if len(mover.moves) != 2 {
			t.Errorf("mover moved %v, want 2 moves", mover.moves)
		}
	})
}

func TestPlacerFailedMoveIsAnEvent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mover := &fakeMover{where: map[string]string{"a": "cuda:0", "b": "cuda:0"}, failOn: "a"}
		snapshot := func() ([]PlacementDevice, []PlacementModel) {
			return gpus(2, 40*gib), []PlacementModel{lcModel("a", 0.7, "cuda:0"), lcModel("b", 0.6, "cuda:0")}
		}
		p, err := NewPlacer(PlacerOptions{Snapshot: snapshot, Mover: mover})
		if err != nil {
			t.Fatal(err)
		}
		if moves := p.Pass(t.Context()); len(moves) != 0 {
			t.Fatalf("moves %v, want none (the move failed)", moves)
		}
		ev := p.Events(time.Time{}, 0)
		if len(ev) != 1 || ev[0].Kind != EventError || !strings.Contains(ev[0].Reason, "no room") {
			t.Errorf("events %+v, want one error saying why", ev)
		}
	})
}

func TestPlacerPlaceSeesPending(t *testing.T) {
	// Models loading at the same time see each other's placement before
	// either is in the snapshot.
	p, err := NewPlacer(PlacerOptions{Snapshot: func() ([]PlacementDevice, []PlacementModel) { return gpus(2, 40*gib), nil }})
	if err != nil {
		t.Fatal(err)
	}
	a, err := p.Place(lcModel("a", 0.5, ""))
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Place(lcModel("b", 0.5, ""))
	if err != nil {
		t.Fatal(err)
	}
	if a == b {
		t.Errorf("a and b both on %s, want them apart", a)
	}
	pinned := lcModel("p", 0.5, a)
	pinned.Pinned = true
	if got, _ := p.Place(pinned); got != a {
		t.Errorf("pinned model placed on %s, want its own %s", got, a)
	}
	// c goes beside b rather than beside a and the pinned model.
	if c, _ := p.Place(lcModel("c", 0.5, "")); c != b {
		t.Errorf("c placed on %s, want %s (a and the pinned p are on %s)", c, b, a)
	}
	if again, _ := p.Place(lcModel("a", 0.5, "")); again != a {
		t.Errorf("a placed again on %s, want %s (its first placement)", again, a)
	}
	if ev := p.Events(time.Time{}, 0); len(ev) != 3 || ev[0].Kind != EventPlace {
		t.Errorf("events %+v, want three placements (none for the pinned model)", ev)
	}
}
