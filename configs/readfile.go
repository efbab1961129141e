package configs

import (
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
)

// MaxConfigFile bounds every config file read: the server config, a model's
// config.yaml, and the certificate, key and token files it names. A real
// one is a few kilobytes.
const MaxConfigFile = 1 << 20

var (
	// ErrNotRegular is wrapped when a config path names something other
	// than a regular file (a device such as /dev/zero, a FIFO, a socket, a
	// folder), directly or through a symbolic link.
	ErrNotRegular = errors.New("not a regular file")
	// ErrTooLarge is wrapped when a config file is larger than MaxConfigFile.
	ErrTooLarge = errors.New("file too large")
)

// ReadFile reads the config file at path: a regular file (symbolic links
// followed, as in a Kubernetes ConfigMap or Secret volume) of at most
// MaxConfigFile bytes. It is opened non-blocking, so a FIFO cannot hang the
// caller; its type and size are checked on the open descriptor, so swapping
// the file between a check and the open does not help; and it is read
// through a limit, so a file that grows cannot exhaust memory. Errors name path. Every reader of
// a config file goes through here.
func ReadFile(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if err := checkConfigFile(path, st); err != nil {
		return nil, err
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxConfigFile+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(data) > MaxConfigFile {
		return nil, fmt.Errorf("%s: %w (more than %d bytes)", path, ErrTooLarge, MaxConfigFile)
	}
	return data, nil
}

func checkConfigFile(path string, st os.FileInfo) error {
	if !st.Mode().IsRegular() {
		return fmt.Errorf("%s is %w (%s)", path, ErrNotRegular, describeMode(st.Mode()))
	}
	if st.Size() > MaxConfigFile {
		return fmt.Errorf("%s: %w (%d bytes; at most %d allowed)", path, ErrTooLarge, st.Size(), MaxConfigFile)
	}
	return nil
}

func describeMode(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "a folder"
	case m&os.ModeNamedPipe != 0:
		return "a FIFO"
	case m&os.ModeCharDevice != 0:
		return "a character device"
	case m&os.ModeDevice != 0:
		return "a block device"
	case m&os.ModeSocket != 0:
		return "a socket"
	}
	return "mode " + m.String()
}
