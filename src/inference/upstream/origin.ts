/** Where a base URL connects to: host (IPv6 without brackets), port, and a key naming the pair. */
export interface Origin {
  hostname: string;
  port: number;
  key: string;
}

export function originOf(baseUrl: string): Origin {
  const u = new URL(baseUrl);
  const port = u.port ? Number(u.port) : u.protocol === "https:" ? 443 : 80;
  const hostname = u.hostname.replace(/^\[|\]$/g, "");
  return { hostname, port, key: `${hostname}:${port}` };
}
