import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[1]; data = rows[2:]
ix = {h:i for i,h in enumerate(hdr)}
reasons = [h for h in hdr if h.startswith('stall_') and '(Not Issued)' not in h]
base = int(data[0][0],16)
regions = [tuple(int(x,16) for x in r.split('-')) for r in sys.argv[2:]]
for lo,hi in regions:
    c = collections.Counter(); n=0; ins=0
    for r in data:
        a = int(r[0],16)-base
        if lo <= a < hi:
            for h in reasons: c[h[6:]] += int(r[ix[h]] or 0)
            n += int(r[ix['Warp Stall Sampling (All Samples)']] or 0)
            ins += int(r[ix['Instructions Executed']] or 0)
    print(f'{lo:05x}-{hi:05x} samples {n} warp-instr executed {ins} ', ' '.join(f'{k}:{v}' for k,v in c.most_common(9)))
