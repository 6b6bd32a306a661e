// compose-check loads a Compose file with compose-go, the loader `docker compose config` uses:
// schema validation, interpolation, merging of extension fields and anchors, and the consistency
// checks (services, volumes and networks that are referenced exist). It prints the resolved
// project as JSON on stdout, or the loader's error on stderr with exit status 1.
//
//	compose-check [-f FILE]...
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"

	"github.com/compose-spec/compose-go/v2/cli"
)

type files []string

func (f *files) String() string     { return fmt.Sprint(*f) }
func (f *files) Set(v string) error { *f = append(*f, v); return nil }

func main() {
	var paths files
	flag.Var(&paths, "f", "Compose file (repeatable; default: compose.yaml/docker-compose.yml here)")
	flag.Parse()
	opts, err := cli.NewProjectOptions(paths,
		cli.WithOsEnv,
		cli.WithDotEnv,
		cli.WithDefaultConfigPath,
		cli.WithConsistency(true),
		cli.WithResolvedPaths(true),
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, "compose-check:", err)
		os.Exit(1)
	}
	project, err := opts.LoadProject(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, "compose-check:", err)
		os.Exit(1)
	}
	out, err := json.MarshalIndent(project, "", "  ")
	if err != nil {
		fmt.Fprintln(os.Stderr, "compose-check:", err)
		os.Exit(1)
	}
	fmt.Println(string(out))
}
